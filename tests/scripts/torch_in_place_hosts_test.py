#!/usr/bin/python3
"""PyTorch DDP in place across namespace hosts (issue 27): bench/in_place_torch.py's trial,
in place, twice. Four hosts: rdzvd on host 0, one agent on each of hosts 1-3, each running
examples/python/ddp_in_place.py (python3-torch, gloo). Past step 60: host 2's agent and its
worker killed -9; then, in fresh hosts, host 2 cut silently (iptables DROP, no FIN, no RST)
with the process group's timeout at 300 s, so that only the pushed abort can end the
survivors' blocked collectives within the trial's 120 s.

    torch_in_place_hosts_test.py BUILD_DIR SOURCE_DIR

It checks that rank 0 completed a step after the kill, that no new process started on the
surviving hosts (they re-formed in their own processes), that both survivors print the same
parameter digest after the re-form, and that nothing read the checkpoint. How fast is bench/'s
to say, not this test's. hostnet ends whatever is left on any host by its pid.

Exits 77 (ctest: Skipped) without root, the namespace tools or python3-torch.
"""
import json
import os
import shutil
import subprocess
import sys


# Under tests/support/in_torch_root.sh: the wheel's launch and the python3 of a root with
# torch 2.x (docs/testing.md, "PyTorch 2.x"); otherwise the build's and Debian 12's.
PYTHON = os.environ.get("MUSTER_TEST_PYTHON") or "/usr/bin/python3"
LAUNCH = os.environ.get("MUSTER_TEST_LAUNCH") or ""


def main():
    build, src = sys.argv[1], sys.argv[2]
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("torch_in_place_hosts_test: SKIPPED (needs root and ip)")
        return 77
    if subprocess.run([PYTHON, "-c", "import torch.distributed"],
                      capture_output=True).returncode != 0:
        print("torch_in_place_hosts_test: SKIPPED (%s cannot import torch: "
              "install python3-torch)" % PYTHON)
        return 77
    problems = []
    for fault in ("kill", "cut"):
        problems += trial(build, src, fault)
    for p in problems:
        print("FAIL  " + p)
    return 1 if problems else 0


def trial(build, src, fault):
    # The group's timeout is far above the test's bound: a cut recovers only by the push.
    cmd = [os.path.join(build, "tests/hostnet"), "run", "4", "--", "/usr/bin/python3",
           os.path.join(src, "bench/in_place_torch.py"), "--inner", "--way", "in_place",
           "--step_ms", "10", "--fault", fault, "--pg_timeout", "300"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, BUILD=build, PYTHON=PYTHON,
                                **({"LAUNCH": LAUNCH} if LAUNCH else {})))
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        return ["%s: no result; exit %d\n%s\n%s" % (fault, r.returncode, r.stdout[-2000:],
                                                    r.stderr[-2000:])]
    res = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps(res))
    problems = []
    if "error" in res:
        problems.append("the trial failed: " + res["error"])
    if res.get("kill_to_step_s") is None:
        problems.append("no step after the kill")
    if res.get("new_processes_on_survivors") != 0:
        problems.append("new processes started on the surviving hosts: %s"
                        % res.get("new_processes_on_survivors"))
    if res.get("survivors_same_params") is not True:
        problems.append("the survivors do not agree on their parameters after the re-form")
    if res.get("checkpoint_read") is not False:
        problems.append("a checkpoint was read")
    # The bench's own wait for a step after the fault is 120 s, far below the 300 s timeout:
    # a cut that recovered at all was ended by the pushed abort.
    return ["%s: %s" % (fault, p) for p in problems]


if __name__ == "__main__":
    sys.exit(main())
