"""What the benchmark scripts share."""
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request


def drop_page_cache(tool, consequence, fatal=False):
    """Starts a run cold: sync, then drop the page cache. Under cgroup v1 a
    page stays charged to the cgroup that first read it, so file pages left
    by an earlier run would be free to the next one and hide what it really
    needs. Where that is refused (not root), says so as `tool` with
    `consequence`, and exits if `fatal`; returns whether the cache went."""
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        msg = f"{tool}: cannot drop the page cache ({e}); {consequence}"
        if fatal:
            sys.exit(msg)
        print(msg, file=sys.stderr)
        return False


def venv_python(tool, work, packages):
    """The python of a virtual environment in `work`/venv with `packages`
    (pinned) installed, made on first use: for a script that needs what the
    system's python lacks. A failed step exits naming it, as `tool`."""
    venv = os.path.join(work, "venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        for cmd in ([sys.executable, "-m", "venv", venv], [py, "-m", "pip", "install", "-q"] + packages):
            p = subprocess.run(cmd)
            if p.returncode != 0:
                # Half made, it would pass for made next time.
                shutil.rmtree(venv, ignore_errors=True)
                sys.exit(f"{tool}: {' '.join(cmd)} failed (exit {p.returncode})")
    return py


def free_port():
    """A port free on 127.0.0.1 now, for a server a benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, proc, timeout):
    """Waits until the llama-server at `url` answers /health with 200, the
    process `proc` exits, or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
