#!/usr/bin/python3
"""deploy/kubernetes/'s manifests run as their pods would (issue 39), on namespace hosts:
each pod's command and environment are read from its manifest, plus what its operator injects
(Kubeflow's PyTorchJob v1, elastic and not; Kubeflow Trainer v2; a plain JobSet's fieldRef),
with the image's muster-launch and muster-rdzvd being this build's and the program a script
that prints its rank. Every pod name resolves, as through a headless service, to its host:
at once, and late (published only after every agent has said it is waiting for the name).
Every agent must exit 0 with the whole world formed; no flag is added.

    kubernetes_test.py BUILD_DIR SOURCE_DIR

Exits 77 (ctest: Skipped) without root, the namespace tools or python3-yaml.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HOSTS = 3
PROGRAM = "/workspace/train.py"  # the manifests' program, replaced by TRAIN below
TRAIN = 'import os\nprint("rank %s of %s" % (os.environ["RANK"], os.environ["WORLD_SIZE"]), flush=True)\n'


def docs_of(src, name):
    import yaml
    with open(os.path.join(src, "deploy", "kubernetes", name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def container(pod_template):
    return pod_template["spec"]["containers"][0]


# Each returns the pods: (name, the DNS names that resolve to it, command, env, is_agent).
def pytorchjob_elastic(src):
    docs = docs_of(src, "pytorchjob-elastic.yaml")
    dep, svc, job = of_kind(docs, "Deployment")[0], of_kind(docs, "Service")[0], of_kind(docs, "PyTorchJob")[0]
    pods = [(dep["metadata"]["name"], [svc["metadata"]["name"]],
             container(dep["spec"]["template"])["command"], {}, False)]
    el, name = job["spec"]["elasticPolicy"], job["metadata"]["name"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    for i in range(worker["replicas"]):
        c = container(worker["template"])
        env = {"PYTHONUNBUFFERED": "1", "PET_NNODES": f"{el['minReplicas']}:{el['maxReplicas']}",
               "PET_NPROC_PER_NODE": str(job["spec"]["nprocPerNode"]),
               "PET_RDZV_ENDPOINT": f"{el['rdzvHost']}:{el['rdzvPort']}",
               "PET_RDZV_BACKEND": el["rdzvBackend"], "PET_MAX_RESTARTS": str(el["maxRestarts"]),
               "PET_RDZV_ID": name, "PET_STANDALONE": ""}
        pods.append((f"{name}-worker-{i}", [f"{name}-worker-{i}"], c["command"] + c.get("args", []), env, True))
    return pods, el["maxReplicas"] * int(job["spec"]["nprocPerNode"])


def pytorchjob(src):
    job = of_kind(docs_of(src, "pytorchjob.yaml"), "PyTorchJob")[0]
    name, specs = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"]
    roles = [("master", specs["Master"])] + [("worker", specs["Worker"])]
    total = sum(s["replicas"] for _, s in roles)
    pods, rank = [], 0
    for role, spec in roles:
        for i in range(spec["replicas"]):
            c = container(spec["template"])
            env = {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": f"{name}-master-0",
                   "PET_MASTER_ADDR": f"{name}-master-0", "MASTER_PORT": "23456",
                   "PET_MASTER_PORT": "23456", "WORLD_SIZE": str(total), "RANK": str(rank),
                   "PET_NODE_RANK": str(rank), "PET_NNODES": str(total),
                   "PET_NPROC_PER_NODE": str(job["spec"]["nprocPerNode"])}
            pods.append((f"{name}-{role}-{i}", [f"{name}-{role}-{i}"], c["command"] + c.get("args", []), env, True))
            rank += 1
    return pods, total * int(job["spec"]["nprocPerNode"])


def trainer(src):
    rt = of_kind(docs_of(src, "trainer-runtime.yaml"), "ClusterTrainingRuntime")[0]
    n, nproc = rt["spec"]["mlPolicy"]["numNodes"], rt["spec"]["mlPolicy"]["torch"]["numProcPerNode"]
    rj = rt["spec"]["template"]["spec"]["replicatedJobs"][0]
    c = container(rj["template"]["spec"]["template"])
    trainjob = "train"  # a TrainJob of that name uses the runtime
    pods = []
    for i in range(n):
        env = {"PET_NNODES": str(n), "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(i),
               "PET_MASTER_ADDR": f"{trainjob}-{rj['name']}-0-0.{trainjob}", "PET_MASTER_PORT": "29500"}
        pods.append((f"{trainjob}-{rj['name']}-0-{i}", [f"{trainjob}-{rj['name']}-0-{i}.{trainjob}"],
                     c["command"] + c.get("args", []), env, True))
    return pods, n * nproc


def jobset(src):
    js = of_kind(docs_of(src, "jobset.yaml"), "JobSet")[0]
    name, rj = js["metadata"]["name"], js["spec"]["replicatedJobs"][0]
    job = rj["template"]["spec"]
    c = container(job["template"])
    pods = []
    for i in range(job["completions"]):
        env = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif "job-completion-index" in e["valueFrom"]["fieldRef"]["fieldPath"]:
                env[e["name"]] = str(i)
        pods.append((f"{name}-{rj['name']}-0-{i}", [f"{name}-{rj['name']}-0-{i}.{name}"],
                     c["command"] + c.get("args", []), env, True))
    return pods, int(env["PET_NNODES"]) * int(env["PET_NPROC_PER_NODE"])


SCENARIOS = {"pytorchjob-elastic": pytorchjob_elastic, "pytorchjob": pytorchjob,
             "trainer-v2": trainer, "jobset": jobset}


class Pod:
    def __init__(self, argv, env):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines = []
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()
        with self.cv:
            self.cv.notify_all()

    def wait_line(self, pattern, timeout):
        end = time.monotonic() + timeout
        with self.cv:
            while not any(re.search(pattern, x) for x in self.lines):
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.reader.is_alive()):
                    return False
                self.cv.wait(left)
        return True

    def text(self):
        with self.cv:
            return "\n".join(self.lines)


def inner(build, src):
    n = int(os.environ["HOSTNET_N"])
    hosts_files = [f"/etc/netns/{os.environ[f'HOSTNET_NS_{i}']}/hosts" for i in range(n)]
    original = [open(f).read() for f in hosts_files]
    tmp = tempfile.mkdtemp(prefix="muster_k8s_")
    train = os.path.join(tmp, "train.py")
    with open(train, "w") as f:
        f.write(TRAIN)
    tools = {"muster-launch": os.path.join(build, "launcher", "launch"),
             "muster-rdzvd": os.path.join(build, "rendezvous", "rdzvd")}
    problems = []
    for scenario, make in SCENARIOS.items():
        for late in (False, True):
            pods, world = make(src)
            tag = f"{scenario}{' (names published late)' if late else ''}"
            publish = "".join(f"{os.environ[f'HOSTNET_ADDR_{i}']}\t{' '.join(names)}\n"
                              for i, (_, names, _, _, _) in enumerate(pods))
            if not late:
                for f in hosts_files:
                    with open(f, "a") as h:
                        h.write(publish)
            running = []
            for i, (name, _, command, env, _) in enumerate(pods):
                argv = [tools.get(a, train if a == PROGRAM else a) for a in command]
                penv = {"PATH": os.environ["PATH"], "PYTHON_EXEC": "/usr/bin/python3",
                        "HOME": tmp, **env}
                running.append(Pod(shlex.split(os.environ[f"HOSTNET_WRAP_{i}"]) + argv, penv))
            agents = [p for p, pod in zip(running, pods) if pod[4]]
            published_at = None
            if late:
                waiting = all(a.wait_line("looking it up again", 30) for a in agents)
                if not waiting:
                    problems.append(f"{tag}: an agent did not say it waits for the name")
                published_at = time.monotonic()
                for f in hosts_files:
                    with open(f, "a") as h:
                        h.write(publish)
            codes = []
            for a in agents:
                try:
                    codes.append(a.proc.wait(timeout=120))
                except subprocess.TimeoutExpired:
                    a.proc.kill()
                    codes.append(a.proc.wait())
            done = time.monotonic()
            for p, pod in zip(running, pods):
                if not pod[4]:
                    p.proc.terminate()
                    p.proc.wait(timeout=30)
            out = "\n".join(a.text() for a in agents)
            ranks = sorted(set(re.findall(rf"rank (\d+) of {world}\b", out)))
            ok = codes == [0] * len(agents) and ranks == [str(r) for r in range(world)]
            extra = f", {done - published_at:.2f} s from the names' publication to the end" if late else ""
            print(f"kubernetes_test: {tag}: exit codes {codes}, ranks {ranks} of {world}{extra}")
            if not ok:
                problems.append(f"{tag}: exit codes {codes}, ranks {ranks} of {world}:\n{out}")
            for f, text in zip(hosts_files, original):
                with open(f, "w") as h:  # the same file (bind-mounted into each host): truncated
                    h.write(text)
    shutil.rmtree(tmp, ignore_errors=True)
    for p in problems:
        print("kubernetes_test: " + p)
    return 1 if problems else 0


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--inner":
        return inner(sys.argv[2], sys.argv[3])
    build, src = sys.argv[1], sys.argv[2]
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("kubernetes_test: SKIPPED (needs root and ip)")
        return 77
    try:
        import yaml  # noqa: F401
    except ImportError:
        print("kubernetes_test: SKIPPED (no python3-yaml)")
        return 77
    r = subprocess.run([os.path.join(build, "tests", "hostnet"), "run", str(HOSTS), "--",
                        sys.executable, os.path.abspath(__file__), "--inner", build, src])
    if r.returncode != 0:
        print(f"kubernetes_test: FAILED (exit {r.returncode})")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
