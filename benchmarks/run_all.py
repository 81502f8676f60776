"""Run every benchmark at its default size, one at a time, and print a table of what each took
(`make bench`; docs/benchmarks.md, "Default sizes and how long each benchmark takes").

For each benchmark it prints, after the benchmark's own output: its wall time, the CPU time
(user + sys) of its whole process tree, the load average before and after, an estimate of its
wall time on a quiet 2-core machine, and whether its goal was met. The table at the end has
one row a benchmark and the totals; the exit status is 1 when any benchmark missed its goal,
printed none (a benchmark that only informs says "no goal"), or failed.

How the quiet 2-core estimate is made (the machine this runs on may be shared, so the wall
time also counts the time other work held the CPUs): every second the runner reads, for every
thread of every process in the benchmark's session, the time it ran and the time it waited for
a CPU (/proc/PID/task/TID/schedstat). Over each second, with c core-seconds run and r waited,
the threads wanted d = (c + r) / 1 s cores on average:
  d >= 1: the second was all work; on a quiet 2-core machine it takes c / min(d, 2) seconds
          (its single-thread parts at one core, its parallel parts at two);
  d < 1:  part of the second nothing ran or waited (disk, sleeps, a child starting): it keeps
          that time and only loses the wait, 1 s - r.
The sum over the seconds is the estimate; it lies between CPU / 2 and the wall time. Where
/proc has no schedstat the estimate is CPU / 2 plus nothing (marked '~').

CPU time: the larger of the kernel's count for the benchmark's process and every descendant it
waited for (wait4) and the sum of the last CPU time sampled for each process of its session (a
process left running or not waited for).
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TICK = os.sysconf("SC_CLK_TCK")
GOAL = re.compile(r"goal", re.I)
BUDGET_S = 30 * 60  # `make bench` on a quiet 2-core machine
NO_GOAL = re.compile(r"\bno goal\b", re.I)  # a benchmark that says it judges nothing
# the benchmarks' words for a missed goal; a verdict the benchmark measures (bench_cachecheck's
# "NOT PASSED" of an engine with unjudged scenarios) is its data, judged by its own met / MISSED
MISS = re.compile(r"MISSED|NOT met|goal missed", re.I)


def _session_pids(sid: int) -> list:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    out.append(int(name))
            except OSError:
                pass
    return out


def _read(path: str):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class Sampler(threading.Thread):
    """Once a second: CPU time of each process of the session, and each thread's run / wait."""

    def __init__(self, sid: int, period: float = 1.0):
        super().__init__(daemon=True)
        self.sid, self.period = sid, period
        self.proc_cpu = {}        # (pid, starttime) -> last utime + stime, seconds
        self.threads = {}         # (pid, tid, starttime) -> (run ns, wait ns) last seen
        self.quiet = 0.0          # estimated seconds on a quiet 2-core machine
        self.schedstat = True
        self.stop = threading.Event()

    def sample(self):
        c = r = 0
        for pid in _session_pids(self.sid):
            stat = _read(f"/proc/{pid}/stat")
            if stat is None:
                continue
            f = stat[stat.rfind(")") + 2:].split()
            start = f[19]
            self.proc_cpu[(pid, start)] = (int(f[11]) + int(f[12])) / TICK
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                s = _read(f"/proc/{pid}/task/{tid}/schedstat")
                if s is None:
                    if not os.path.exists("/proc/self/schedstat"):
                        self.schedstat = False
                    continue
                run, wait = (int(x) for x in s.split()[:2])
                key = (pid, tid, start)
                run0, wait0 = self.threads.get(key, (0, 0))  # a new thread: all of its time
                c += run - run0
                r += wait - wait0
                self.threads[key] = (run, wait)
        return c / 1e9, r / 1e9

    def run(self):
        self.last = time.monotonic()
        self.sample()
        while not self.stop.wait(self.period):
            now = time.monotonic()
            dt, self.last = now - self.last, now
            c, r = self.sample()
            d = (c + r) / dt if dt > 0 else 0.0
            self.quiet += c / min(d, 2.0) if d >= 1.0 else max(dt - r, 0.0)

    def finish(self, t_end: float):
        self.stop.set()
        self.join()
        # after the last sample (under a second): counted at the wall clock
        self.quiet += max(t_end - self.last, 0.0)


def run_one(script: Path, args: list, timeout: float | None) -> dict:
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    # unbuffered: its lines show as they are printed, and a benchmark cut by --timeout keeps them
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, stdout=subprocess.PIPE, env=env,
                         stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    sampler = Sampler(p.pid)
    sampler.start()
    lines = []

    def pump():
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if timeout and time.monotonic() - t0 > timeout and not timed_out:
                timed_out = True
                os.killpg(p.pid, signal.SIGKILL)
            time.sleep(0.2)
    except KeyboardInterrupt:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    t_end = time.monotonic()
    wall = t_end - t0
    reader.join(timeout=10)
    try:  # nothing the benchmark started outlives it
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    sampler.finish(t_end)
    p.returncode = os.waitstatus_to_exitcode(status)
    cpu = max(ru.ru_utime + ru.ru_stime, sum(sampler.proc_cpu.values()))
    quiet = sampler.quiet if sampler.schedstat else cpu / 2
    text = "".join(lines)
    goal_lines = [ln.strip() for ln in lines if GOAL.search(ln)]
    if timed_out:
        verdict = f"TIMED OUT ({timeout:.0f} s)"
    elif p.returncode == 0:
        verdict = ("no goal printed" if not goal_lines else "MISSED (exit 0)" if MISS.search(text)
                   else "informational (no goal)" if all(NO_GOAL.search(g) for g in goal_lines) else "met")
    elif p.returncode == 1 and goal_lines and "Traceback (most recent call last)" not in text:
        verdict = "MISSED"  # the benchmarks' convention: exit 1 when a goal is missed
    else:
        verdict = f"FAILED (exit {p.returncode})"
    return dict(name=script.name, wall=wall, cpu=cpu, quiet=min(max(quiet, cpu / 2), wall),
                estimated=sampler.schedstat, load0=load0, load1=os.getloadavg()[0],
                verdict=verdict, goals=len(goal_lines), rc=p.returncode)


def table(rows: list) -> str:
    out = ["| benchmark | wall s | CPU s (user+sys) | quiet 2-core est. s | load 1 min | goal lines | goal |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        q = f"{r['quiet']:.0f}" if r["estimated"] else f"~{r['quiet']:.0f}"
        out.append(f"| {r['name']} | {r['wall']:.0f} | {r['cpu']:.0f} | {q} | "
                   f"{r['load0']:.1f}-{r['load1']:.1f} | {r['goals']} | {r['verdict']} |")
    tw, tc, tq = (sum(r[k] for r in rows) for k in ("wall", "cpu", "quiet"))
    out.append(f"| total | {tw:.0f} ({tw / 60:.1f} min) | {tc:.0f} | {tq:.0f} ({tq / 60:.1f} min) | | | |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scripts", nargs="*", help="benchmarks to run (default: every benchmarks/bench_*.py)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds each benchmark may run")
    ap.add_argument("--table", type=Path, help="also write the final table (markdown) to this file")
    a = ap.parse_args()
    scripts = [Path(s) for s in a.scripts] or sorted(HERE.glob("bench_*.py"))
    missing = [s for s in scripts if not s.is_file()]
    if missing:
        print(f"run_all: no such benchmark: {missing[0]}", file=sys.stderr)
        return 2
    rows = []
    for s in scripts:
        print(f"== {s.name} (load {os.getloadavg()[0]:.1f})", flush=True)
        r = run_one(s.resolve(), [], a.timeout)
        rows.append(r)
        print(f"== {s.name}: wall {r['wall']:.0f} s, CPU {r['cpu']:.0f} s, quiet 2-core estimate "
              f"{r['quiet']:.0f} s, load {r['load0']:.1f}-{r['load1']:.1f}, goal: {r['verdict']}", flush=True)
        if a.table:
            a.table.write_text(table(rows) + "\n")
    print()
    print(table(rows))
    quiet = sum(r["quiet"] for r in rows)
    print(f"quiet 2-core estimate of the whole run: {quiet / 60:.1f} min, "
          f"{'within' if quiet <= BUDGET_S else 'OVER'} the {BUDGET_S // 60} min budget (issue 24)")
    bad = [r["name"] for r in rows if r["verdict"] not in ("met", "informational (no goal)")]
    if bad:
        print("goal missed, not printed, or failed: " + " ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
