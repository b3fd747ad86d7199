// launch under a real srun: a one-node Slurm cluster made for each test (munged, slurmctld and
// slurmd with a private config, spool, state, logs and munge socket in a temporary folder,
// ports picked free), and `srun launch ...` forming its job from Slurm's environment alone.
//
// The whole Slurm side runs in a PID namespace of its own: this binary, run as
// `slurm_tests --slurm-init DIR` under `unshare --pid --fork --mount-proc --kill-child`, is the
// namespace's init (pid 1). It starts the three daemons, says "ready" once each has logged its
// start line, and then only reaps orphans (the step daemons, slurmstepd, that slurmd forks and
// that detach end up its children). The test ends that init by its pid with SIGKILL, and the
// kernel then kills every process of the namespace, slurmstepd included; the test checks that
// no process of that namespace is left (by the namespace's inode, never by name). srun itself
// runs outside, as the test's child, and talks to slurmctld and slurmd over TCP on 127.0.0.1.
//
// Exits 77 (ctest: Skipped) without Slurm's daemons and munge (scripts/setup installs
// slurmctld, slurmd, slurm-client, munge) or unshare, or when not root (slurmd starts steps
// as root; namespaces need it).
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "helpers.h"
#include "proc.h"

using namespace muster::testing;

namespace {

std::string self_exe;  // this binary, for the namespace's init

// Slurm's daemons are in sbin, which a user's PATH may lack: the system folders, PATH aside.
std::string find_in_system_dirs(const std::string& name) {
  for (const char* dir :
       {"/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/sbin", "/usr/local/bin"}) {
    std::string candidate = std::string(dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

std::string short_hostname() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  std::string h = name;
  return h.substr(0, h.find('.'));
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// ---- The namespace's init (pid 1), run as `slurm_tests --slurm-init DIR`. ----

struct Daemon {
  std::string name;  // its log is DIR/<name>.log
  std::vector<std::string> argv;
  std::string ready;  // the log line that says it is up
  pid_t pid = -1;
};

pid_t spawn(const std::string& dir, const Daemon& d, const sigset_t& old_mask) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    int log = ::open((dir + "/" + d.name + ".log").c_str(),
                     O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (log < 0 || null < 0) ::_exit(127);
    ::dup2(null, 0);
    ::dup2(log, 1);
    ::dup2(log, 2);
    std::vector<char*> argv;
    for (const auto& a : d.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// Reaps every child that has exited; returns the name of a daemon among them, if any.
std::string reap(const std::vector<Daemon>& daemons, int* status_out) {
  std::string died;
  int st;
  pid_t pid;
  while ((pid = ::waitpid(-1, &st, WNOHANG)) > 0) {
    for (const Daemon& d : daemons) {
      if (d.pid == pid) {
        died = d.name;
        *status_out = st;
      }
    }
  }
  return died;
}

int slurm_init(const std::string& dir) {
  // Signals as events: SIGCHLD through a signalfd. The test's end of our stdout closing (the
  // test is gone) also ends us, and with us the namespace.
  sigset_t mask, old_mask;
  ::sigemptyset(&mask);
  ::sigaddset(&mask, SIGCHLD);
  ::sigprocmask(SIG_BLOCK, &mask, &old_mask);
  const int sfd = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  const int ifd = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (sfd < 0 || ifd < 0 || ::inotify_add_watch(ifd, dir.c_str(), IN_MODIFY | IN_CREATE) < 0) {
    std::fprintf(stderr, "slurm-init: signalfd/inotify: %s\n", std::strerror(errno));
    return 1;
  }
  const std::string conf = dir + "/slurm.conf";
  const std::string host = short_hostname();
  std::vector<Daemon> daemons{
      {"munged",
       {find_in_system_dirs("munged"), "-F", "--key-file=" + dir + "/munge/key",
        "--socket=" + dir + "/run/munge.sock", "--pid-file=" + dir + "/munge/pid",
        "--log-file=" + dir + "/munged.log", "--seed-file=" + dir + "/munge/seed"},
       "Created socket"},
      {"slurmctld",
       {find_in_system_dirs("slurmctld"), "-D", "-i", "-f", conf},
       "Running as primary controller"},
      {"slurmd", {find_in_system_dirs("slurmd"), "-D", "-f", conf, "-N", host}, "slurmd started on"},
  };
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  for (Daemon& d : daemons) {
    d.pid = spawn(dir, d, old_mask);
    // Waits for its start line: every write to its log is an inotify event.
    for (;;) {
      if (slurp(dir + "/" + d.name + ".log").find(d.ready) != std::string::npos) break;
      int st = 0;
      std::string died = reap(daemons, &st);
      if (!died.empty()) {
        std::fprintf(stderr, "slurm-init: %s exited (status 0x%x) before it was ready:\n%s\n",
                     died.c_str(), st, slurp(dir + "/" + died + ".log").c_str());
        return 1;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        std::fprintf(stderr, "slurm-init: %s not ready after 60 s:\n%s\n", d.name.c_str(),
                     slurp(dir + "/" + d.name + ".log").c_str());
        return 1;
      }
      pollfd p[2] = {{ifd, POLLIN, 0}, {sfd, POLLIN, 0}};
      ::poll(p, 2, static_cast<int>(left.count()));
      char buf[4096];
      while (::read(ifd, buf, sizeof buf) > 0) {
      }
      signalfd_siginfo si;
      while (::read(sfd, &si, sizeof si) > 0) {
      }
    }
  }
  std::printf("slurm-init: ready\n");
  std::fflush(stdout);
  ::close(ifd);
  // From here on: reap orphans (slurmstepd and its tasks) until killed, or until the test's
  // end of our stdout is gone (POLLERR on a pipe's write end).
  for (;;) {
    pollfd p[2] = {{sfd, POLLIN, 0}, {1, 0, 0}};
    ::poll(p, 2, -1);
    if (p[1].revents & (POLLERR | POLLHUP | POLLNVAL)) return 1;
    signalfd_siginfo si;
    while (::read(sfd, &si, sizeof si) > 0) {
    }
    int st = 0;
    std::string died = reap(daemons, &st);
    if (!died.empty()) {
      std::fprintf(stderr, "slurm-init: %s exited (status 0x%x)\n", died.c_str(), st);
    }
  }
}

// ---- The test's side. ----

// The inode of process `pid`'s PID namespace; 0 when it cannot be read.
ino_t pid_ns_of(pid_t pid) {
  struct stat st {};
  if (::stat(("/proc/" + std::to_string(pid) + "/ns/pid").c_str(), &st) != 0) return 0;
  return st.st_ino;
}

std::vector<pid_t> all_pids() {
  std::vector<pid_t> pids;
  if (DIR* d = ::opendir("/proc")) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] >= '1' && e->d_name[0] <= '9') pids.push_back(std::atoi(e->d_name));
    }
    ::closedir(d);
  }
  return pids;
}

// The processes (host pids) whose PID namespace is `ns`.
std::vector<pid_t> pids_in_ns(ino_t ns) {
  std::vector<pid_t> out;
  for (pid_t pid : all_pids()) {
    if (pid_ns_of(pid) == ns) out.push_back(pid);
  }
  return out;
}

// The children of `parent`, by the PPid line of /proc/PID/status.
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (pid_t pid : all_pids()) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("PPid:", 0) == 0) {
        if (std::atoi(line.c_str() + 5) == parent) out.push_back(pid);
        break;
      }
    }
  }
  return out;
}

std::string ps_of(const std::vector<pid_t>& pids) {
  std::string s;
  for (pid_t pid : pids) {
    std::string comm = slurp("/proc/" + std::to_string(pid) + "/comm");
    if (!comm.empty() && comm.back() == '\n') comm.pop_back();
    s += std::to_string(pid) + " " + comm + "\n";
  }
  return s;
}

// The one-node cluster in its PID namespace.
class Cluster {
 public:
  Cluster() {
    const std::string d = dir_.path();
    // munged wants its socket's folders searchable by all, and its key private.
    REQUIRE(::chmod(d.c_str(), 0755) == 0);
    REQUIRE(::mkdir((d + "/munge").c_str(), 0700) == 0);
    for (const char* sub : {"/run", "/state", "/spool", "/out"}) {
      REQUIRE(::mkdir((d + sub).c_str(), 0755) == 0);
    }
    {
      std::ifstream rnd("/dev/urandom", std::ios::binary);
      std::string key(1024, '\0');
      rnd.read(key.data(), static_cast<std::streamsize>(key.size()));
      std::ofstream(d + "/munge/key", std::ios::binary) << key;
      REQUIRE(::chmod((d + "/munge/key").c_str(), 0600) == 0);
    }
    conf_ = d + "/slurm.conf";
    std::ofstream(conf_) << "ClusterName=muster\n"
                         << "SlurmctldHost=" << host_ << "(127.0.0.1)\n"
                         << "SlurmctldPort=" << free_port() << "\n"
                         << "SlurmdPort=" << free_port() << "\n"
                         << "SlurmUser=root\nSlurmdUser=root\n"
                         << "AuthType=auth/munge\nCredType=cred/munge\n"
                         << "AuthInfo=socket=" << d << "/run/munge.sock\n"
                         << "StateSaveLocation=" << d << "/state\n"
                         << "SlurmdSpoolDir=" << d << "/spool\n"
                         << "SlurmctldPidFile=" << d << "/ctld.pid\n"
                         << "SlurmdPidFile=" << d << "/slurmd.pid\n"
                         << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
                         << "JobAcctGatherType=jobacct_gather/none\n"
                         << "AccountingStorageType=accounting_storage/none\n"
                         << "SwitchType=switch/none\nMpiDefault=none\n"
                         << "SchedulerType=sched/builtin\nSelectType=select/linear\n"
                         << "ReturnToService=2\nKillWait=1\n"
                         << "NodeName=" << host_ << " NodeAddr=127.0.0.1 CPUs="
                         << std::max(2L, ::sysconf(_SC_NPROCESSORS_ONLN)) << " State=UNKNOWN\n"
                         << "PartitionName=p Nodes=" << host_
                         << " Default=YES State=UP MaxTime=INFINITE\n";
    init_ = std::make_unique<Proc>(
        std::vector<std::string>{find_in_system_dirs("unshare"), "--pid", "--fork", "--mount-proc",
                                 "--kill-child", "--", self_exe, "--slurm-init", d});
    bool up = init_->wait_output(
        [](const std::string& out, const std::string&) {
          return out.find("slurm-init: ready") != std::string::npos;
        },
        90s);
    INFO("slurm-init:\n" << init_->out() << init_->err() << logs());
    REQUIRE(up);
    // unshare's one child is the namespace's init.
    auto kids = children_of(init_->pid());
    REQUIRE(kids.size() == 1);
    ns_pid1_ = kids[0];
    ns_pidfd_ = open_pidfd(ns_pid1_);
    REQUIRE(ns_pidfd_ >= 0);
    ns_ = pid_ns_of(ns_pid1_);
    REQUIRE(ns_ != 0);
    REQUIRE(ns_ != pid_ns_of(::getpid()));
  }

  ~Cluster() { stop(); }

  // Ends the namespace's init by its pid (the kernel then kills the rest of the namespace)
  // and returns what is left of the namespace: nothing, unless something went wrong.
  std::vector<pid_t> stop() {
    if (stopped_) return {};
    stopped_ = true;
    if (ns_pid1_ > 0) {
      ::kill(ns_pid1_, SIGKILL);
      // The init exits only after every other process of its namespace is gone.
      wait_pidfd(ns_pidfd_, 30s);
      ::close(ns_pidfd_);
    }
    if (init_) init_->wait(30s);  // unshare, which follows its child; else killed by pid
    init_.reset();
    return ns_ != 0 ? pids_in_ns(ns_) : std::vector<pid_t>{};
  }

  std::string logs() const {
    std::string s;
    for (const char* n : {"munged", "slurmctld", "slurmd"}) {
      s += std::string("--- ") + n + ".log\n" + slurp(dir_.path() + "/" + n + ".log");
    }
    return s;
  }

  // The namespace's processes now (host pids): its init and the daemons at least.
  std::vector<pid_t> running() const { return pids_in_ns(ns_); }

  const std::string& host() const { return host_; }
  std::string out_dir() const { return dir_.path() + "/out"; }

  // srun's environment: the test's own, less any Slurm job or launch settings around the test.
  std::map<std::string, std::optional<std::string>> env() const {
    std::map<std::string, std::optional<std::string>> e{{"SLURM_CONF", conf_},
                                                        {"LOGLEVEL", "INFO"}};
    for (const char* k :
         {"MASTER_ADDR", "MASTER_PORT", "MUSTER_SCHEDULER_ENV", "MUSTER_LOG_LEVEL", "PET_NNODES",
          "PET_NODE_RANK", "PET_NPROC_PER_NODE", "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID",
          "SLURM_STEPID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_NODELIST",
          "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES"}) {
      e[k] = std::nullopt;
    }
    return e;
  }

 private:
  TempDir dir_;  // declared first: removed last
  std::string host_ = short_hostname();
  std::string conf_;
  std::unique_ptr<Proc> init_;  // unshare, whose child is the namespace's init
  pid_t ns_pid1_ = -1;
  int ns_pidfd_ = -1;
  ino_t ns_ = 0;
  bool stopped_ = false;
};

}  // namespace

TEST_CASE("srun -N1 --ntasks-per-node=1 launch: the job from Slurm's environment", "[slurm]") {
  Cluster c;
  {
    // MASTER_PORT (a free pair, never a fixed port): launch takes it over the job-id rule,
    // which the unit tests cover (tests/unit/scheduler_env_test.cc).
    const int master_port = free_port_pair();
    REQUIRE(master_port > 0);
    auto env = c.env();
    env["MASTER_PORT"] = std::to_string(master_port);
    Proc p({find_in_system_dirs("srun"), "-N1", "--ntasks-per-node=1", kLaunch, "--nproc_per_node=2",
            kWorker, "env", c.out_dir()},
           env);
    auto rc = p.wait(120s);
    INFO("stdout:\n" << p.out() << "\nstderr:\n" << p.err() << c.logs());
    REQUIRE(rc.has_value());
    CHECK(*rc == 0);
    static const std::regex job_re(R"(slurm: job (\d+) step 0, node 0 of 1)");
    std::smatch m;
    REQUIRE(std::regex_search(p.err(), m, job_re));
    const int job = std::stoi(m[1]);
    const std::string port = std::to_string(master_port);
    for (int rank : {0, 1}) {
      const std::string file = c.out_dir() + "/env." + std::to_string(rank);
      INFO(file);
      REQUIRE(::access(file.c_str(), R_OK) == 0);
      auto env = read_env_file(file);
      CHECK(env["RANK"] == std::to_string(rank));
      CHECK(env["LOCAL_RANK"] == std::to_string(rank));
      CHECK(env["WORLD_SIZE"] == "2");
      CHECK(env["GROUP_RANK"] == "0");
      CHECK_THAT(env["TORCHELASTIC_RUN_ID"], Catch::StartsWith("slurm-"));
      CHECK(env["TORCHELASTIC_RUN_ID"] == "slurm-" + std::to_string(job) + ".0");
      CHECK(env["MASTER_ADDR"] == c.host());
      CHECK(env["MASTER_PORT"] == port);
    }
  }
  // The scan that checks the end sees the namespace's init, munged, slurmctld and slurmd now.
  {
    auto now = c.running();
    INFO("in the Slurm namespace:\n" << ps_of(now));
    CHECK(now.size() >= 4);
  }
  auto left = c.stop();
  INFO("left in the Slurm namespace:\n" << ps_of(left));
  CHECK(left.empty());
}

TEST_CASE("srun -N1 -n2 launch: two tasks on one node are refused", "[slurm]") {
  Cluster c;
  {
    Proc p({find_in_system_dirs("srun"), "-N1", "-n2", kLaunch, "--nproc_per_node=2", kWorker, "env",
            c.out_dir()},
           c.env());
    auto rc = p.wait(120s);
    INFO("stdout:\n" << p.out() << "\nstderr:\n" << p.err() << c.logs());
    REQUIRE(rc.has_value());
    CHECK(*rc != 0);
    CHECK_THAT(p.err(), Catch::Contains("srun started 2 tasks on 1 nodes; launch needs one per "
                                        "node (srun --ntasks-per-node=1)"));
    CHECK(::access((c.out_dir() + "/env.0").c_str(), F_OK) != 0);  // no worker started
  }
  // The scan that checks the end sees the namespace's init, munged, slurmctld and slurmd now.
  {
    auto now = c.running();
    INFO("in the Slurm namespace:\n" << ps_of(now));
    CHECK(now.size() >= 4);
  }
  auto left = c.stop();
  INFO("left in the Slurm namespace:\n" << ps_of(left));
  CHECK(left.empty());
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--slurm-init") return slurm_init(argv[2]);
  char exe[4096] = {};
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) {
    std::printf("skipped: cannot read /proc/self/exe\n");
    return kSkipExit;
  }
  self_exe.assign(exe, static_cast<std::size_t>(n));
  for (const char* tool : {"munged", "slurmctld", "slurmd", "srun", "unshare"}) {
    if (find_in_system_dirs(tool).empty()) {
      std::printf("skipped: no %s (apt-get install slurmctld slurmd slurm-client munge)\n", tool);
      return kSkipExit;
    }
  }
  if (::geteuid() != 0) {
    std::printf("skipped: needs root (slurmd starts steps as root; a PID namespace)\n");
    return kSkipExit;
  }
  return catch_exit(Catch::Session().run(argc, argv));
}
