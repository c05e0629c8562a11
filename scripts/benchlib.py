"""What the benchmark scripts share."""
import json
import os
import shutil
import signal
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


def without_sdq_env():
    """This environment without its SDQ_ variables: a run's settings are
    the flags the benchmark gives it."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SDQ_")}


def fresh_files(tmp, *names):
    """The paths of `names` in `tmp`, none left from an earlier run."""
    paths = [os.path.join(tmp, n) for n in names]
    for p in paths:
        if os.path.exists(p):
            os.remove(p)
    return paths


def post_json(url, body, timeout):
    """POSTs the JSON `body` to `url`; returns the answer's JSON."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


def complete(url, prompt, n, timeout):
    """A greedy /completion of `n` tokens, the prompt not cached; returns
    (the text, llama-server's timings)."""
    v = post_json(url + "/completion", {"prompt": prompt, "n_predict": n, "top_k": 1, "cache_prompt": False}, timeout)
    return v["content"], v["timings"]


def serve(row, make_cmd, err_path, timeout, use, stop_timeout=120, env=None):
    """Runs llama-server as `make_cmd(port)` gives it (stderr into
    `err_path`, no SDQ_ variables but those of `env`), calls `use(url)` once
    it answers /health, and stops it. A request that fails (OSError) sets
    `row`'s exit_code to 1 and its error; a failed row gets stderr's tail.
    Returns the server's exit code."""
    port = free_port()
    with open(err_path, "w+") as err:
        p = subprocess.Popen(make_cmd(port), env={**without_sdq_env(), **(env or {})}, stdout=subprocess.DEVNULL, stderr=err,
                             stdin=subprocess.DEVNULL)
        row.setdefault("exit_code", 0)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", p, timeout)
            use(f"http://127.0.0.1:{port}")
        except OSError as e:
            row["exit_code"] = 1
            row["error"] = str(e)
        finally:
            p.terminate()
            code = p.wait(timeout=stop_timeout)
        if row["exit_code"]:
            row["stderr_tail"] = stderr_tail(err)
    return code


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


class RpcNode:
    """One rpc-server on a free loopback port: sdq's, paging from `model`
    under `budget` when given (else upstream's RPC), inside
    `sdq limit --memory LIMIT [--read-rate R]` when `limit` is given. Its
    stdout and stderr go to `log`; `stop()` ends it with SIGINT (its summary
    line and stats file) and returns the limit's report, if any."""

    def __init__(self, bin_dir, work, name, model=None, budget=None, limit=None, read_rate=None, threads=1, env=None):
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = os.path.join(work, f"{name}.log")
        self.stats = os.path.join(work, f"{name}.json") if budget else None
        self.report = os.path.join(work, f"{name}-limit.json") if limit else None
        cmd = []
        if limit:
            cmd = [os.path.join(bin_dir, "sdq"), "limit", "--memory", str(limit), "--report", self.report]
            if read_rate:
                cmd += ["--read-rate", str(read_rate)]
            cmd += ["--"]
        cmd += [os.path.join(bin_dir, "rpc-server"), "-H", "127.0.0.1", "-p", str(self.port), "-t", str(threads)]
        if budget:
            cmd += ["-m", model, "--ram-budget", str(budget), "--sdq-stats", self.stats]
        with open(self.log, "w") as log:
            self.runner = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        self.pid = self._server_pid()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.runner.poll() is not None:
                sys.exit(f"rpc-server {name} exited early:\n{open(self.log).read()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        sys.exit(f"rpc-server {name} not listening within 120 s")

    def _server_pid(self):
        """The rpc-server's pid (the runner's child under `sdq limit`)."""
        if not self.report:
            return self.runner.pid
        for _ in range(200):
            try:
                with open(f"/proc/{self.runner.pid}/task/{self.runner.pid}/children") as f:
                    kids = f.read().split()
                if kids:
                    return int(kids[0])
            except OSError:
                pass
            time.sleep(0.05)
        return self.runner.pid

    def stop(self):
        """SIGINT (sdq writes its stats and summary, then the signal ends
        it); returns (the limit's report or None, the node's log)."""
        try:
            os.kill(self.pid, signal.SIGINT)
            self.runner.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.runner.kill()
            self.runner.wait()
        report = None
        if self.report and os.path.exists(self.report):
            with open(self.report) as f:
                report = json.load(f)
        with open(self.log, errors="replace") as f:
            return report, f.read()

    def read_stats(self):
        with open(self.stats) as f:
            return json.load(f)


def read_json(path):
    """The JSON file at `path`, or None where there is none or it is not
    JSON (a run that ended before writing it)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def limit_figures(report):
    """What `sdq limit --report` measured of a run: its cgroup's peak
    (page cache counted), swap and OOM kills; {} without a report."""
    lim = read_json(report) or {}
    return {"peak_cgroup_bytes": lim.get("peak_bytes"), "oom_kills": lim.get("oom_kills"), "swap_bytes": lim.get("swap_bytes")} if lim else {}


def stats_figures(stats, keys):
    """The stats file's figures `keys` (None for one it lacks); {} without
    a stats file."""
    s = read_json(stats)
    return {k: s.get(k) for k in keys} if s else {}


def stderr_tail(err):
    """The last 2,000 characters of a run's stderr, kept in the file `err`."""
    err.seek(0)
    return err.read()[-2000:]


def write_table(out, name, md, tool, differ, failed, what="answers differ"):
    """Writes the table `md` to OUT/NAME.md and prints it; exits naming the
    runs whose text differs (`what`) or that failed."""
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)
    if differ or failed:
        sys.exit(f"{tool}: {what}: {differ}; failed: {failed}")


def run_session(cmd, timeout, env=None):
    """Runs `cmd` in a session of its own, so that a run past `timeout`
    is killed with everything it started (`sdq limit` and its tool) and
    nothing else. Returns (exit code or None when killed, stdout, stderr)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                         errors="backslashreplace", start_new_session=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, err


def trace_records(path):
    """A routing trace (`--sdq-trace`'s CSV), line by line: ("layer", its
    header's fields as strings, line) for a layer's `# layer=L ...` header;
    ("use", (step, phase, layer, expert, weight), line) for an expert a
    step used (step, layer and expert as ints, phase and weight as
    written); ("other", None, line) for anything else."""
    with open(path) as f:
        for line in f.read().splitlines():
            if line.startswith("# layer="):
                yield "layer", dict(kv.split("=") for kv in line[2:].split()), line
            elif line[:1].isdigit():
                step, phase, layer, expert, weight = line.split(",")
                yield "use", (int(step), phase, int(layer), int(expert), weight), line
            else:
                yield "other", None, line
