#!/usr/bin/env python3
"""`cargo xtask gpu-check`: memory held at the allocation (`--memory-at-alloc kill`),
checked on a real GPU with real CUDA programs.

Run as root on a GPU node with genv 1.4.3 and a genv-enforcer build (`cargo xtask
gpu-check` builds one and passes it; on a node without cargo, run this file with
`--enforcer PATH`, and `--genv PATH` where genv is not on PATH). It starts
`genv-enforcer enforce --event-driven --memory-at-alloc kill` on a private genv state
directory, then, for each workload, in a genv environment made by genv's own shell
commands (`genv activate`, `genv attach --index GPU`, `genv config gpu-memory CAP`):

1. the workload starts CUDA and says so; after SETTLE seconds (past the daemon's memory
   poll, which takes the context into its figure), its NVML usage is the context
   overhead of this run;
2. once the daemon holds the environment's cap in the kernel, the check has the workload
   allocate STEP MiB at a time, then FINE_STEP MiB once within APPROACH MiB of the cap,
   one allocation per request; after each that returned, it reads NVML's figure for the
   environment (until it shows the allocation) before the next. It stops at twice the
   cap. The workloads allocate and never launch a kernel (a kernel would load modules
   and grow the context after the overhead was read).

It passes when, for every workload:
- the allocations up to the cap returned, and the one killed would have crossed it: its
  total with the overhead is over the cap, the last one's is not (within TOLERANCE MiB,
  the driver's rounding);
- the process died of SIGKILL in that call, which never returned;
- NVML, read after every allocation and sampled every 50 ms throughout, never showed the
  environment over its cap (within TOLERANCE), and showed every allocation that returned;
- the daemon said `... killed process P at the allocation` for it, and never that it
  could not.

With `--mode refuse` (`cargo xtask gpu-check -- --mode refuse --workloads torch`: the
PyTorch case), each workload must instead be refused at the cap: PyTorch's allocator,
given CUDA_ERROR_OUT_OF_MEMORY, frees its cache and retries, then raises
`torch.OutOfMemoryError`, which the workload catches; it then frees its last block,
allocates half of what was refused and finishes with status 0. It passes when the
refusal came at the crossing (as above), the error was the library's OutOfMemoryError,
the smaller allocation returned, the process lived, NVML never showed the environment
over its cap, and the daemon said `refused an allocation ... by process P`. It fails on
a kernel that cannot refuse (the daemon then kills, and says so at start).

Workloads: `torch` (PyTorch's caching allocator: cuMemAlloc), `torch-expandable`
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: cuMemCreate), `cupy`, and `fake`
(the test suite's cuda-user on the fake libcuda and NVML: how the suite checks this
script without a GPU). The report (Markdown) goes to --report, and to stdout.
"""

import argparse
import ctypes
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

MIB = 1 << 20

# A program in a genv shell: start CUDA, say `context`, then for each `go N` line
# allocate N MiB and say the total; anything else (or the end of input) ends it.
#
# Refused (`--memory-at-alloc refuse`), the library raises the driver's out-of-memory
# (`torch.OutOfMemoryError`): the program says `refused`, then does what a batch-size
# finder does: frees its last block and the library's cache, allocates half of what was
# refused, and says `recovered` with its total.
LOOP = """
print("context", flush=True)
sizes = [0]
while True:
    line = sys.stdin.readline()
    if not line.startswith("go "):
        break
    mib = int(line.split()[1])
    try:
        held.append({alloc})
        {sync}
    except Exception as refused:
        print("refused", total, type(refused).__name__, flush=True)
        held.pop()
        total -= sizes.pop()
        {release}
        mib //= 2
        held.append({alloc})
        {sync}
        sizes.append(mib)
        total += mib
        print("recovered", total, flush=True)
        continue
    sizes.append(mib)
    total += mib
    print("allocated", total, flush=True)
"""
# Per library: how it starts CUDA (holding a first, tiny allocation), allocates N MiB,
# and waits for the device.
LIBRARIES = {
    "torch": (
        'import sys, torch\ntorch.cuda.init()\nheld, total = [torch.empty(1, device="cuda")], 0\n'
        "torch.cuda.synchronize()\n",
        'torch.empty(mib * 1048576, dtype=torch.uint8, device="cuda")',
        "torch.cuda.synchronize()",
        "torch.cuda.empty_cache()",
    ),
    "cupy": (
        "import sys, cupy\nheld, total = [cupy.empty(1, dtype=cupy.uint8)], 0\n"
        "cupy.cuda.Device().synchronize()\n",
        "cupy.empty(mib * 1048576, dtype=cupy.uint8)",
        "cupy.cuda.Device().synchronize()",
        "cupy.get_default_memory_pool().free_all_blocks()",
    ),
}
PROGRAMS = {
    name: start + LOOP.format(alloc=alloc, sync=sync, release=release)
    for name, (start, alloc, sync, release) in LIBRARIES.items()
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


class Failure(Exception):
    pass


class Lines:
    """A stream's lines, read by a thread, kept and waited on."""

    def __init__(self, stream, echo):
        self.seen, self.queue, self.ended = [], queue.Queue(), False

        def read():
            for line in stream:
                line = line.rstrip("\n")
                print(f"{echo}{line}", file=sys.stderr, flush=True)
                self.queue.put(line)
            self.queue.put(None)

        threading.Thread(target=read, daemon=True).start()

    def next(self, timeout):
        """The next line; None at the end or after `timeout` seconds."""
        if self.ended:
            return None
        try:
            line = self.queue.get(timeout=max(timeout, 0))
        except queue.Empty:
            return None
        if line is None:
            self.ended = True
        else:
            self.seen.append(line)
        return line

    def expect(self, *needles, timeout, since=0):
        """The first line from the `since`th on (seen or to come) holding all `needles`."""
        deadline = time.monotonic() + timeout
        for line in self.seen[since:]:
            if all(n in line for n in needles):
                return line
        while time.monotonic() < deadline:
            line = self.next(deadline - time.monotonic())
            if line is None and self.ended:
                break
            if line is not None and all(n in line for n in needles):
                return line
        raise Failure(f"the daemon did not say {' … '.join(needles)!r} within {timeout:.0f} s")


class Nvml:
    """The environment's usage on the GPU as NVML reports it per process, read through
    `genv-enforcer usage snapshot`; and a thread sampling it every 50 ms for the peak."""

    def __init__(self, args, env, eid):
        self.args, self.env, self.eid = args, env, eid
        self.peak, self.samples, self.errors = 0, 0, []
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
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
        self.peak = max(self.peak, used)
        return used

    def at_least(self, floor, timeout=5):
        """NVML's figure once it is `floor` or more (the driver's list can lag the
        call's return), or the last one read after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            used = self.now()
            if used >= floor or time.monotonic() > deadline:
                return used
            time.sleep(0.05)

    def sample(self):
        while self.running:
            try:
                self.now()
                self.samples += 1
            except Exception as e:  # said in the report, never dropped
                self.errors.append(str(e))
            time.sleep(0.05)

    def stop(self):
        self.running = False
        self.thread.join()


class Workload:
    """One workload's process in its genv environment, driven one allocation at a time."""

    def __init__(self, args, env, name, eid):
        setup = (
            f'eval "$(genv shell --init)"; genv activate --id {eid} --no-prompt'
            f" && genv attach --index {args.gpu} && genv config gpu-memory {args.cap}"
        )
        env = dict(env, **ENVIRONMENT.get(name, {}))
        self.fake, self.name = name == "fake", name
        if self.fake:
            # cuda-user: one call a line, answered `ok VALUE` or `err CODE`.
            script = f'{setup} && exec "$CUDA_USER"'
        else:
            env["GC_PROGRAM"] = PROGRAMS[name]
            script = f'{setup} && exec {shlex.quote(args.python)} -u -c "$GC_PROGRAM"'
        # exec: the process checked is the workload itself, with the shell's pid.
        self.process = subprocess.Popen(
            ["bash", "-c", script], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr,
        )
        self.lines = Lines(self.process.stdout, echo=f"[{name}] ")
        self.total = 0
        # Under `refuse`: the total before the refused allocation and the library's
        # error; the total once it allocated less.
        self.refused, self.recovered = None, None

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
        line = self.lines.next(timeout)
        if line != "context":
            raise Failure(f"the workload did not start CUDA: {line!r}")

    def allocate(self, mib, timeout):
        """One allocation of `mib` MiB: the total after it, or None if it never returned
        (the process is gone)."""
        self.say(f"alloc {mib}" if self.fake else f"go {mib}")
        line = self.lines.next(timeout)
        if line is None:
            return None
        if self.fake and line.startswith("ok"):
            self.total += mib
        elif self.fake and line == "err 2":
            self.refused = (self.total, "CUDA_ERROR_OUT_OF_MEMORY")
        elif line.startswith("refused "):
            words = line.split()
            self.refused = (int(words[1]), words[2] if len(words) > 2 else "?")
            after = self.lines.next(timeout) or ""
            if after.startswith("recovered "):
                self.recovered = self.total = int(after.split()[1])
        elif line.startswith("allocated "):
            self.total = int(line.split()[1])
        else:
            raise Failure(f"unexpected answer to an allocation: {line!r}")
        return self.total

    def finish(self, timeout):
        """Ends the input (the workload then exits); its exit status, or None."""
        try:
            self.process.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


def check(args, env, daemon, name):
    """One workload; its row of the report, the daemon's lines about it, and whether it
    passed."""
    eid = f"gc-{name}"
    cap, tol = parse_size(args.cap), args.tolerance * MIB
    since = len(daemon.seen)
    workload = Workload(args, env, name, eid)
    nvml = Nvml(args, env, eid)
    problems, last_seen, requested = [], 0, 0
    try:
        workload.start_cuda(args.timeout)
        time.sleep(args.settle)
        overhead = nvml.now()
        daemon.expect("caps held at the allocation: ", f"{eid} {args.cap}",
                      timeout=args.timeout, since=since)
        while workload.total * MIB < 2 * cap:
            near = workload.total * MIB + overhead + args.step * MIB > cap - args.approach * MIB
            requested = args.fine_step if near else args.step
            total = workload.allocate(requested, args.timeout)
            if total is None or workload.refused:
                break
            last_seen = nvml.at_least(total * MIB + overhead - tol)
            if last_seen < total * MIB + overhead - tol:
                problems.append(f"NVML showed {last_seen // MIB} MiB after {total} MiB returned")
            if last_seen > cap + tol:
                problems.append(f"NVML showed {last_seen // MIB} MiB, over the cap")
        status = workload.finish(args.timeout)
    finally:
        nvml.stop()
        if workload.process.poll() is None:
            workload.process.kill()
    pid, returned = workload.process.pid, workload.total
    if args.mode == "refuse":
        return refused_row(args, daemon, since, workload, (status, overhead, requested), nvml)
    if status != -signal.SIGKILL:
        problems.append(f"the workload ended with {status}, not SIGKILL")
    else:
        if returned * MIB + overhead > cap + tol:
            problems.append(f"{returned} MiB returned, over the cap with the overhead")
        if (returned + requested) * MIB + overhead <= cap - tol:
            problems.append(f"killed at {returned + requested} MiB, with room left under the cap")
    if nvml.peak > cap + tol:
        problems.append(f"NVML's peak {nvml.peak // MIB} MiB is over the cap")
    if nvml.errors:
        problems.append(f"NVML sampling failed {len(nvml.errors)} times: {nvml.errors[0]}")
    said = [line for line in daemon.seen[since:] if f"process {pid} at the allocation" in line]
    if any(f"could NOT kill process {pid}" in line for line in daemon.seen[since:]):
        problems.append("the daemon could not kill it")
    if status == -signal.SIGKILL and not any(f"killed process {pid} at" in l for l in said):
        try:
            said.append(daemon.expect(f"killed process {pid} at the allocation",
                                      timeout=10, since=since))
        except Failure as e:
            problems.append(str(e))
    end = "SIGKILL" if status == -signal.SIGKILL else status
    row = (
        f"| {name} | {args.cap} | {args.step}/{args.fine_step} MiB | {overhead // MIB} MiB "
        f"| {returned} MiB | {returned + requested} MiB | {last_seen // MIB} MiB "
        f"| {nvml.peak // MIB} MiB ({nvml.samples} samples) | {end} "
        f"| {'pass' if not problems else 'FAIL: ' + '; '.join(problems)} |"
    )
    return row, said, not problems


def refused_row(args, daemon, since, workload, run, nvml):
    """`--mode refuse`: the row of a workload that should have been refused at the cap
    (the library raising the driver's out-of-memory), lived, allocated less and
    finished."""
    status, overhead, requested = run
    cap, tol, pid = parse_size(args.cap), args.tolerance * MIB, workload.process.pid
    problems = []
    if workload.refused is None:
        problems.append("no allocation was refused")
        before, error = workload.total, "-"
    else:
        before, error = workload.refused
        if before * MIB + overhead > cap + tol:
            problems.append(f"{before} MiB returned, over the cap with the overhead")
        if (before + requested) * MIB + overhead <= cap - tol:
            problems.append(f"refused at {before + requested} MiB, with room left")
        if "OutOfMemoryError" not in error:
            problems.append(f"the library raised {error}, not its OutOfMemoryError")
    if workload.recovered is None:
        problems.append("it did not allocate less after the refusal")
    if status != 0:
        problems.append(f"the workload ended with {status}, not 0: it should have lived")
    if nvml.peak > cap + tol:
        problems.append(f"NVML's peak {nvml.peak // MIB} MiB is over the cap")
    said = []
    try:
        said.append(daemon.expect(f"by process {pid} (CUDA_ERROR_OUT_OF_MEMORY)",
                                  timeout=10, since=since))
    except Failure as e:
        problems.append(str(e))
    row = (
        f"| {workload_name(workload)} | {args.cap} | {args.step}/{args.fine_step} MiB "
        f"| {overhead // MIB} MiB | {before} MiB | refused at {before + requested} MiB ({error}) "
        f"| then {workload.recovered} MiB | {nvml.peak // MIB} MiB ({nvml.samples} samples) "
        f"| {status} | {'pass' if not problems else 'FAIL: ' + '; '.join(problems)} |"
    )
    return row, said, not problems


def workload_name(workload):
    return "fake" if workload.fake else workload.name


def die_with_parent():
    """In the daemon's child, before exec: SIGTERM when this script goes, however."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--enforcer", required=True, help="the genv-enforcer binary")
    parser.add_argument("--genv", help="genv's executable (default: genv on PATH)")
    parser.add_argument("--python", default=sys.executable,
                        help="the Python with torch and cupy (default: this one)")
    parser.add_argument("--workloads", default="torch,torch-expandable,cupy")
    parser.add_argument("--cap", default="4g", help="the environments' gpu_memory")
    parser.add_argument("--step", type=int, default=512, help="MiB per allocation")
    parser.add_argument("--fine-step", type=int, default=32,
                        help="MiB per allocation within APPROACH of the cap: how closely "
                             "the crossing is located")
    parser.add_argument("--approach", type=int, default=1024, help="MiB")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--mode", default="kill", choices=["kill", "report", "refuse"],
                        help="--memory-at-alloc (report: the check must fail; refuse: the "
                             "program must be refused at the cap, live, allocate less and "
                             "finish, which needs a kernel that lets uprobes set registers)")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds between CUDA's start and reading the overhead")
    parser.add_argument("--tolerance", type=int, default=64,
                        help="MiB of the driver's rounding allowed around the cap")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--state-dir", help="genv's state directory (default: a fresh one)")
    parser.add_argument("--report", help="also write the Markdown report here")
    parser.add_argument("daemon_args", nargs="*", help="more `enforce` flags, after --")
    args = parser.parse_args()
    for name in args.workloads.split(","):
        if name not in PROGRAMS and name != "fake":
            parser.error(f"--workloads: unknown workload {name!r}")
    return args


def main():
    args = parse_args()
    if os.geteuid() != 0:
        sys.exit("gpu-check: run it as root (the daemon loads kernel programs)")
    # A SIGTERM (a timeout's) runs the cleanup below like any exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    scratch = tempfile.mkdtemp(prefix="genv-gpu-check.")
    state = args.state_dir or os.path.join(scratch, "genv")
    os.makedirs(state, exist_ok=True)
    env = dict(os.environ, GENV_TMPDIR=state)
    env.pop("GENV_ENVIRONMENT_ID", None)
    if args.genv:
        # Only genv: the directory it lives in may hold another python3.
        os.symlink(os.path.abspath(args.genv), os.path.join(scratch, "genv"))
        env["PATH"] = f"{scratch}:{env.get('PATH', '')}"
    command = [args.enforcer, "enforce", "--event-driven", "--verbose",
               "--memory-at-alloc", args.mode, "--interval", "3600",
               "--run-dir", os.path.join(scratch, "run")] + args.daemon_args
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    daemon = subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    lines = Lines(daemon.stdout, echo="[daemon] ")
    rows, said, passed = [], [], True
    try:
        lines.expect("are held to their environment's gpu_memory", timeout=args.timeout)
        for name in args.workloads.split(","):
            try:
                row, about, ok = check(args, env, lines, name)
            except Failure as e:
                row, about, ok = f"| {name} | {args.cap} | | | | | | | | FAIL: {e} |", [], False
            rows.append(row)
            said += about
            passed &= ok
    except Failure as e:
        rows.append(f"| (daemon) | | | | | | | | | FAIL: {e} |")
        passed = False
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(scratch, ignore_errors=True)
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader", "-i", str(args.gpu)],
                             capture_output=True, text=True, env=env, timeout=30)
        gpu = gpu.stdout.strip() or f"nvidia-smi: {gpu.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as e:
        gpu = f"nvidia-smi: {e}"
    report = "\n".join([
        f"# gpu-check, {started}",
        "",
        f"- GPU {args.gpu}: {gpu}; kernel {os.uname().release}",
        f"- daemon: `{' '.join(shlex.quote(c) for c in command)}`",
        f"- verdict: {'PASS' if passed else 'FAIL'}",
        "",
        "| workload | cap | steps | context overhead | allocations returned | killed at "
        "| NVML after the last | NVML peak | end | check |",
        "|---|---|---|---|---|---|---|---|---|---|",
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
