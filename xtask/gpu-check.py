#!/usr/bin/env python3
"""`cargo xtask gpu-check`: memory held at the allocation (`--memory-at-alloc kill`),
checked on a real GPU with real CUDA programs.

Run as root on a GPU node with genv 1.4.3 and a genv-enforcer build (`cargo xtask
gpu-check` builds one and passes it; on a node without cargo, run this file with
`--enforcer PATH`). It starts `genv-enforcer enforce --event-driven --memory-at-alloc
kill` on a private genv state directory, then, for each workload, in a genv environment
made by genv's own shell commands (`genv activate`, `genv attach --index 0`, `genv config
gpu-memory CAP`):

1. the workload starts CUDA and says so; its NVML usage then (the process's context, and
   what its library set up) is the context overhead of this run;
2. once the daemon holds the environment's cap in the kernel, it allocates STEP MiB at a
   time, saying the total after each call that returned and pausing (PAUSE) for NVML's
   sampling, up to twice the cap.

It passes when, for every workload:
- the allocations up to the cap returned: the one killed was the first whose total, with
  the overhead, crosses the cap (within TOLERANCE for the driver's rounding);
- the process died of SIGKILL in that call, which never returned;
- NVML, sampled every 50 ms throughout, never showed the environment over its cap by more
  than the overhead, and did show what was allocated (else the sampling judged nothing);
- the daemon said `... killed process P at the allocation` for it.

Workloads: `torch` (PyTorch's caching allocator: cuMemAlloc), `torch-expandable`
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: cuMemCreate), `cupy`, and `fake`
(the test suite's cuda-user on the fake libcuda and NVML: how the suite checks this
script without a GPU). The report (Markdown) goes to --report, or stdout.
"""

import argparse
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time

MIB = 1 << 20

# A program in a genv shell: start CUDA, say `context`, wait for `go`, then allocate.
PROGRAMS = {
    "torch": """
import os, sys, time, torch
torch.cuda.init()
x = torch.empty(1, device="cuda")
torch.cuda.synchronize()
print("context", flush=True)
sys.stdin.readline()
step, limit, held, total = int(os.environ["GC_STEP_MIB"]), int(os.environ["GC_LIMIT_MIB"]), [], 0
while total < limit:
    held.append(torch.empty(step * 1048576, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    total += step
    print("allocated", total, flush=True)
    time.sleep(float(os.environ["GC_PAUSE"]))
print("done", flush=True)
""",
    "cupy": """
import os, sys, time, cupy
x = cupy.empty(1, dtype=cupy.uint8)
cupy.cuda.Device(0).synchronize()
print("context", flush=True)
sys.stdin.readline()
step, limit, held, total = int(os.environ["GC_STEP_MIB"]), int(os.environ["GC_LIMIT_MIB"]), [], 0
while total < limit:
    held.append(cupy.empty(step * 1048576, dtype=cupy.uint8))
    cupy.cuda.Device(0).synchronize()
    total += step
    print("allocated", total, flush=True)
    time.sleep(float(os.environ["GC_PAUSE"]))
print("done", flush=True)
""",
}
PROGRAMS["torch-expandable"] = PROGRAMS["torch"]
ENVIRONMENT = {"torch-expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}


def parse_size(text):
    """A size as genv writes it: bytes, or with k, m, g (powers of 1000: genv's `4g` is
    4 * 10^9 bytes) or ki, mi, gi (powers of 1024, as its snapshots say)."""
    text = text.strip().lower().removesuffix("b")
    units = {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "k": 10**3, "m": 10**6, "g": 10**9}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


class Lines:
    """A stream's lines, read by a thread, kept and waited on."""

    def __init__(self, stream, echo=None):
        self.seen, self.queue, self.ended = [], queue.Queue(), False
        self.echo = echo

        def read():
            for line in stream:
                line = line.rstrip("\n")
                if self.echo:
                    print(f"{self.echo}{line}", file=sys.stderr, flush=True)
                self.queue.put(line)
            self.queue.put(None)

        threading.Thread(target=read, daemon=True).start()

    def next(self, timeout):
        """The next line; None at the end or after `timeout` seconds."""
        if self.ended:
            return None
        try:
            line = self.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            self.ended = True
        else:
            self.seen.append(line)
        return line

    def expect(self, *needles, timeout=60):
        """The first line (seen or to come) containing every one of `needles`."""
        deadline = time.monotonic() + timeout
        for line in self.seen:
            if all(n in line for n in needles):
                return line
        while time.monotonic() < deadline:
            line = self.next(deadline - time.monotonic())
            if line is None and self.ended:
                break
            if line is not None and all(n in line for n in needles):
                return line
        raise Failure(f"the daemon did not say {' … '.join(needles)!r} within {timeout} s")


class Failure(Exception):
    pass


class Sampler:
    """The environment's NVML usage on the GPU, as `genv-enforcer usage snapshot` reads it
    (NVML's per-process used memory), every 50 ms, in a thread."""

    def __init__(self, args, env, eid):
        self.args, self.env, self.eid = args, env, eid
        self.peak, self.samples, self.errors = 0, 0, []
        self.running = True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def now(self):
        out = subprocess.run(
            [self.args.enforcer, "usage", "snapshot", "--type", "processes"],
            env=self.env, capture_output=True, text=True, timeout=30,
        )
        if out.returncode != 0:
            raise Failure(f"usage snapshot failed: {out.stderr.strip()}")
        used = 0
        for process in json.loads(out.stdout)["processes"]:
            if process.get("eid") != self.eid:
                continue
            for usage in process.get("used_gpu_memory") or []:
                if usage["index"] == self.args.gpu:
                    used += parse_size(usage["gpu_memory"])
        return used

    def run(self):
        while self.running:
            try:
                used = self.now()
                self.peak = max(self.peak, used)
                self.samples += 1
            except Exception as e:  # said in the report, never silently dropped
                self.errors.append(str(e))
            time.sleep(0.05)

    def stop(self):
        self.running = False
        self.thread.join()


class Workload:
    """One workload's process in its genv environment, and what it said."""

    def __init__(self, args, env, name, eid):
        cap = args.cap
        setup = (
            f'eval "$(genv shell --init)"; genv activate --id {eid} --no-prompt'
            f" && genv attach --index {args.gpu} && genv config gpu-memory {cap}"
        )
        env = dict(env, GC_STEP_MIB=str(args.step), GC_PAUSE=str(args.pause),
                   GC_LIMIT_MIB=str(2 * parse_size(cap) // MIB))
        env.update(ENVIRONMENT.get(name, {}))
        if name == "fake":
            # Driven from here, call by call (its protocol: one call a line, `ok VALUE`).
            script = f'{setup} && exec "$CUDA_USER"'
        else:
            env["GC_PROGRAM"] = PROGRAMS[name]
            script = f'{setup} && exec python3 -u -c "$GC_PROGRAM"'
        self.fake = name == "fake"
        self.process = subprocess.Popen(
            ["bash", "-c", script], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr,
        )
        self.lines = Lines(self.process.stdout, echo=f"[{name}] ")
        self.step, self.pause = args.step, args.pause
        self.limit = 2 * parse_size(cap) // MIB

    def say(self, line):
        try:
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def start_cuda(self, timeout):
        if self.fake:
            if not (self.lines.next(timeout) or "").startswith("ready"):
                raise Failure("cuda-user did not start")
            for call in ("init", "ctx 0"):
                self.say(call)
                answer = self.lines.next(timeout) or ""
                if not answer.startswith("ok"):
                    raise Failure(f"{call}: {answer!r}")
            return
        while True:
            line = self.lines.next(timeout)
            if line is None:
                raise Failure(f"no `context` line within {timeout} s")
            if line == "context":
                return

    def allocate(self, timeout):
        """Allocations until one does not return; the totals that returned."""
        totals = []
        if not self.fake:
            self.say("go")
        while True:
            if self.fake:
                if (totals[-1] if totals else 0) >= self.limit:
                    self.process.stdin.close()  # cuda-user ends at the end of its input
                    return totals
                self.say(f"alloc {self.step}")
            line = self.lines.next(timeout)
            if line is None:
                return totals
            if self.fake and line.startswith("ok"):
                totals.append((totals[-1] if totals else 0) + self.step)
                time.sleep(self.pause)
            elif line.startswith("allocated "):
                totals.append(int(line.split()[1]))
            elif line == "done":
                return totals

    def wait(self, timeout):
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


def check(args, env, daemon, name):
    """One workload; its row of the report, and whether it passed."""
    eid = f"gc-{name}"
    cap = parse_size(args.cap)
    workload = Workload(args, env, name, eid)
    sampler = Sampler(args, env, eid)
    problems = []
    try:
        workload.start_cuda(args.timeout)
        time.sleep(args.settle)
        overhead = sampler.now()
        daemon.expect("caps held at the allocation: ", f"{eid} {args.cap}", timeout=args.timeout)
        totals = workload.allocate(args.timeout)
        status = workload.wait(args.timeout)
    finally:
        sampler.stop()
        if workload.process.poll() is None:
            workload.process.kill()
    pid = workload.process.pid
    returned = totals[-1] if totals else 0
    if status != -signal.SIGKILL:
        problems.append(f"the workload ended with {status}, not SIGKILL")
    tolerance, returned_b, step = args.tolerance * MIB, returned * MIB, args.step * MIB
    if returned_b + overhead > cap + tolerance:
        problems.append(f"{returned} MiB returned, over the cap with the overhead")
    if status == -signal.SIGKILL and returned_b + step + overhead <= cap - tolerance:
        problems.append(f"killed at {returned + args.step} MiB, with room left under the cap")
    if sampler.peak > cap + overhead:
        problems.append(f"NVML showed {sampler.peak // MIB} MiB, over cap + overhead")
    if sampler.peak + tolerance < returned_b + overhead:
        problems.append(f"NVML never showed what was allocated ({sampler.peak // MIB} MiB "
                        f"at most): the sampling saw too little to judge")
    if sampler.errors:
        problems.append(f"NVML sampling failed {len(sampler.errors)} times: {sampler.errors[0]}")
    said = [l for l in daemon.seen if "at the allocation" in l and f"process {pid} " in l]
    if status == -signal.SIGKILL and not said:
        try:
            said = [daemon.expect(f"killed process {pid} at the allocation", timeout=10)]
        except Failure as e:
            problems.append(str(e))
    row = (
        f"| {name} | {args.cap} | {args.step} MiB | {overhead // MIB} MiB | {returned} MiB "
        f"| {returned + args.step} MiB | {sampler.peak // MIB} MiB ({sampler.samples} samples) "
        f"| {'SIGKILL' if status == -signal.SIGKILL else status} "
        f"| {'pass' if not problems else 'FAIL: ' + '; '.join(problems)} |"
    )
    return row, said, not problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--enforcer", required=True, help="the genv-enforcer binary")
    parser.add_argument("--workloads", default="torch,torch-expandable,cupy")
    parser.add_argument("--cap", default="4g", help="the environments' gpu_memory")
    parser.add_argument("--step", type=int, default=512, help="MiB per allocation")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--mode", default="kill", choices=["kill", "report"],
                        help="--memory-at-alloc (report: the check must fail)")
    parser.add_argument("--pause", type=float, default=0.25,
                        help="seconds between allocations (NVML is sampled every 50 ms)")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds between CUDA's start and the overhead's reading")
    parser.add_argument("--tolerance", type=int, default=64,
                        help="MiB of the driver's rounding allowed around the cap")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--state-dir", help="genv's state directory (default: a fresh one)")
    parser.add_argument("--report", help="write the Markdown report here")
    parser.add_argument("daemon_args", nargs="*",
                        help="more genv-enforcer enforce flags, after --")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("gpu-check: run it as root (the daemon loads kernel programs)")
    state = args.state_dir or subprocess.check_output(
        ["mktemp", "-d", "/tmp/genv-gpu-check.XXXXXX"], text=True).strip()
    env = dict(os.environ, GENV_TMPDIR=state)
    env.pop("GENV_ENVIRONMENT_ID", None)
    command = [args.enforcer, "enforce", "--event-driven", "--verbose",
               "--memory-at-alloc", args.mode, "--interval", "3600",
               "--run-dir", state.rstrip("/") + "-run"] + args.daemon_args
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    daemon = subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    lines = Lines(daemon.stdout, echo="[daemon] ")
    rows, said, passed = [], [], True
    try:
        lines.expect("are held to their environment's gpu_memory", timeout=args.timeout)
        for name in args.workloads.split(","):
            if name not in PROGRAMS and name != "fake":
                sys.exit(f"gpu-check: --workloads: unknown workload {name!r}")
            try:
                row, lines_said, ok = check(args, env, lines, name)
            except Failure as e:
                row, lines_said, ok = f"| {name} | {args.cap} | | | | | | | FAIL: {e} |", [], False
            rows.append(row)
            said += lines_said
            passed &= ok
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader", "-i", str(args.gpu)],
                         capture_output=True, text=True, env=env)
    report = "\n".join([
        f"# gpu-check, {started}",
        "",
        f"- GPU {args.gpu}: {gpu.stdout.strip() or 'nvidia-smi: ' + gpu.stderr.strip()}; "
        f"kernel {os.uname().release}",
        f"- daemon: `{' '.join(shlex.quote(c) for c in command)}`",
        f"- verdict: {'PASS' if passed else 'FAIL'}",
        "",
        "| workload | cap | step | context overhead | allocations returned | killed at "
        "| NVML peak | end | check |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The daemon's lines:",
        "",
        *[f"    {line}" for line in said],
        "",
    ])
    if args.report:
        with open(args.report, "w") as f:
            f.write(report)
    print(report)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
