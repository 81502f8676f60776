"""benchmarks/run_all.py (`make bench`): each benchmark's verdict, its CPU time and the table."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "benchmarks" / "run_all.py"

SPIN = """
import sys, time
def spin(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass
"""


def _bench(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(SPIN + body)
    return p


def _run(*scripts, extra=()):
    return subprocess.run([sys.executable, str(RUNNER), *map(str, scripts), *extra],
                          capture_output=True, text=True, timeout=120)


def _row(out, name):
    line = next(ln for ln in out.splitlines() if ln.startswith(f"| {name} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_verdicts_and_exit_status(tmp_path):
    met = _bench(tmp_path, "bench_met.py", "spin(0.3); print('ratio 0.5x, goal <= 1x: met')")
    missed = _bench(tmp_path, "bench_missed.py", "print('ratio 3.0x, goal <= 1x: MISSED'); sys.exit(1)")
    silent = _bench(tmp_path, "bench_silent.py", "print('ratio 0.5x')")
    broken = _bench(tmp_path, "bench_broken.py", "raise ValueError('boom')")
    info = _bench(tmp_path, "bench_info.py", "print('rate 3 MB/s'); print('info: no goal; a property of the API')")
    # a verdict the benchmark reports as data (an engine's NOT PASSED) is not its goal: its own word decides
    data = _bench(tmp_path, "bench_data.py", "print('engine | verdict | goal | met'); print('vllm | NOT PASSED | no FAIL | met')")
    r = _run(met, missed, silent, broken, info, data)
    assert r.returncode == 1, r.stdout + r.stderr
    assert _row(r.stdout, "bench_met.py")[-1] == "met"
    assert _row(r.stdout, "bench_missed.py")[-1] == "MISSED"
    assert _row(r.stdout, "bench_silent.py")[-1] == "no goal printed"
    assert _row(r.stdout, "bench_broken.py")[-1] == "FAILED (exit 1)"
    assert _row(r.stdout, "bench_info.py")[-1] == "informational (no goal)"
    assert _row(r.stdout, "bench_data.py")[-1] == "met"
    assert "goal missed, not printed, or failed: bench_missed.py bench_silent.py bench_broken.py" in r.stdout
    # each benchmark's own output is passed through, then its line of figures
    assert "ratio 0.5x, goal <= 1x: met\n== bench_met.py: wall " in r.stdout

    r = _run(met, info)
    assert r.returncode == 0
    assert re.search(r"quiet 2-core estimate of the whole run: \d+\.\d min, within the 30 min budget", r.stdout), r.stdout


def test_cpu_of_child_processes_is_counted_and_the_quiet_estimate_bounded(tmp_path):
    """Two processes spinning 1 s each: ~2 s of CPU, ~1 s on a quiet 2-core machine; the estimate
    lies between CPU / 2 and the wall time whatever the load."""
    two = _bench(tmp_path, "bench_two.py", """
import multiprocessing as mp
if __name__ == "__main__":
    ps = [mp.Process(target=spin, args=(1.0,)) for _ in range(2)]
    [p.start() for p in ps]; [p.join() for p in ps]
    print('goal: met')
""")
    table = tmp_path / "t.md"
    r = _run(two, extra=("--table", str(table)))
    assert r.returncode == 0, r.stdout + r.stderr
    name, wall, cpu, quiet = _row(r.stdout, "bench_two.py")[:4]
    wall, cpu, quiet = float(wall), float(cpu), float(quiet.lstrip("~"))
    assert 1.5 <= cpu <= 4.0          # both children's seconds, not just the parent's
    assert cpu / 2 - 0.5 <= quiet <= wall + 0.5
    assert table.read_text().splitlines()[2].startswith("| bench_two.py |")


def test_timeout_kills_the_benchmark_and_its_children(tmp_path):
    hang = _bench(tmp_path, "bench_hang.py", """
import subprocess
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
time.sleep(60)
""")
    r = _run(hang, extra=("--timeout", "2"))
    assert r.returncode == 1
    assert _row(r.stdout, "bench_hang.py")[-1] == "TIMED OUT (2 s)"
    assert float(_row(r.stdout, "bench_hang.py")[1]) < 10


def test_a_missing_benchmark_is_one_line_and_exit_2(tmp_path):
    r = _run(tmp_path / "bench_nothere.py")
    assert r.returncode == 2
    assert r.stderr.strip() == f"run_all: no such benchmark: {tmp_path / 'bench_nothere.py'}"
