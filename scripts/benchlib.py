"""What the benchmark scripts share."""
import subprocess
import sys


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
