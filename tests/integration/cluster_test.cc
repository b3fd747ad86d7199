// launch --hosts / --hostfile for real: network-namespace hosts (support/hostnet.h), Debian's
// sshd in each (support/sshd.h) with a key made for the test, and the driver started in host 0
// as a user would start it on a head node. Every process is ended by its pid.
//
// Exits 77 (ctest: Skipped) where namespaces cannot be made (not root) or sshd is missing.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "helpers.h"
#include "hostnet.h"
#include "proc.h"
#include "sshd.h"

using namespace muster::testing;

namespace {

// Hosts 0..n-1, sshd in 1..n-1 (and in 0 when `ssh_on_driver`).
struct Cluster {
  std::unique_ptr<HostNet> net;
  TempDir keys;
  std::unique_ptr<SshHosts> ssh;
  explicit Cluster(int n, std::vector<int> with_sshd = {}) {
    auto made = HostNet::create(n);
    INFO((made.ok() ? std::string() : std::string(made.status().message())));
    REQUIRE(made.ok());
    net = std::move(*made);
    if (with_sshd.empty()) {
      for (int i = 1; i < n; ++i) with_sshd.push_back(i);
    }
    auto started = SshHosts::start(*net, with_sshd, keys.path());
    INFO((started.ok() ? std::string() : std::string(started.status().message())));
    REQUIRE(started.ok());
    ssh = std::move(*started);
  }
  // The driver in host 0: launch FLAGS --ssh_args='-F cfg' PROGRAM... (info logs on, for pids).
  std::unique_ptr<Proc> driver(const std::vector<std::string>& flags,
                               const std::vector<std::string>& program) const {
    std::vector<std::string> argv{kLaunch, "--ssh_args=-F " + ssh->ssh_config()};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), program.begin(), program.end());
    return std::make_unique<Proc>(net->wrap(0, argv),
                                  std::map<std::string, std::optional<std::string>>{
                                      {"LOGLEVEL", "INFO"}, {"MUSTER_LOG_LEVEL", std::nullopt}});
  }
  // Processes in host i besides its sshd (and the sessions sshd forked for the driver).
  std::vector<pid_t> others(int i) const {
    std::vector<pid_t> out;
    for (pid_t p : ns_pids(net->ns(i))) {
      if (p != ssh->sshd_pid(i) && !is_sshd(p)) out.push_back(p);
    }
    return out;
  }
  static bool is_sshd(pid_t p) {
    // sshd's session processes retitle themselves ("sshd: root@notty"): the exe is what counts.
    std::error_code ec;
    return std::filesystem::read_symlink("/proc/" + std::to_string(p) + "/exe", ec)
               .filename() == "sshd";
  }
  // Waits until host i runs nothing but sshd.
  bool quiet(int i, std::chrono::milliseconds within) const {
    const auto deadline = std::chrono::steady_clock::now() + within;
    while (!others(i).empty()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      ::usleep(50'000);  // polling /proc: there is no event for "a namespace emptied"
    }
    return true;
  }
};

auto has(const std::string& what) {
  return [what](const std::string& out, const std::string& err) {
    return out.find(what) != std::string::npos || err.find(what) != std::string::npos;
  };
}

// The pid of host `host`'s ssh client, from the driver's info line.
pid_t ssh_pid(const Proc& driver, const std::string& host) {
  std::smatch m;
  const std::regex re("host " + host + R"(: agent started \(ssh, pid (\d+)\))");
  REQUIRE(std::regex_search(driver.err(), m, re));
  return static_cast<pid_t>(std::stoi(m[1]));
}

}  // namespace

TEST_CASE("cluster: a 2-host job with --hosts runs over ssh, every line prefixed with its host",
          "[cluster]") {
  Cluster k(3);
  TempDir out;
  auto d = k.driver({"--hosts", "node1:2,node2"},
                    {"/bin/sh", "-c",
                     "echo \"hello rank $RANK of $WORLD_SIZE on $(hostname)\"; exec \"$0\" env \"$1\"",
                     kWorker, out.path()});
  const auto rc = d->wait(90s);
  INFO(d->out() << d->err());
  REQUIRE(rc == 0);
  // Three workers: two on node1, one on node2 (--nproc_per_node's default of 1).
  std::map<std::string, int> per_host;
  for (int rank = 0; rank < 3; ++rank) {
    auto env = read_env_file(out.file("env." + std::to_string(rank)));
    INFO("rank " << rank);
    CHECK(env["WORLD_SIZE"] == "3");
    CHECK(env["GROUP_WORLD_SIZE"] == "2");
    CHECK(env.count("MUSTER_STDIN_WATCH") == 0);  // the agent's, not the workers'
    const std::string line = "hello rank " + std::to_string(rank) + " of 3 on ";
    // The worker's line, whole, behind its host and rank: "node1: [default0]:hello ...".
    std::smatch m;
    const std::regex re("(node\\d): \\[default" + std::to_string(rank) + "\\]:" + line +
                        "(node\\d)\n");
    REQUIRE(std::regex_search(d->out(), m, re));
    CHECK(m[1].str() == m[2].str());  // the prefix names the host the worker ran on
    ++per_host[m[1].str()];
    CHECK(env["LOCAL_WORLD_SIZE"] == (m[1].str() == "node1" ? "2" : "1"));
  }
  CHECK(per_host == std::map<std::string, int>{{"node1", 2}, {"node2", 1}});
  CHECK(k.quiet(1, 10s));
  CHECK(k.quiet(2, 10s));
}

TEST_CASE("cluster: a 3-host job from a hostfile, this machine among the hosts", "[cluster]") {
  Cluster k(3);
  TempDir out;
  const std::string hostfile = out.file("hosts");
  std::ofstream(hostfile) << "# DeepSpeed's format, horovod's, and a bare name\n"
                             "node0 slots=1   # the driver's own host: started directly\n"
                             "node1:2\n"
                             "\n"
                             "node2\n";
  auto d = k.driver({"--hostfile", hostfile, "--max_restarts=1"},
                    {kWorker, "restart", out.path(), "1"});
  const auto rc = d->wait(90s);
  INFO(d->out() << d->err());
  REQUIRE(rc == 0);
  CHECK(d->err().find("host node0: agent started (this machine") != std::string::npos);
  CHECK(d->err().find("host node1: agent started (ssh") != std::string::npos);
  // Four workers, one restart counted for the whole job (rank 0 failed once; the others may
  // have been stopped before they wrote their first line).
  CHECK(read_file(out.file("restarts.0")) == "0\n1\n");
  for (int rank = 1; rank < 4; ++rank) {
    INFO("rank " << rank);
    const std::string lines = read_file(out.file("restarts." + std::to_string(rank)));
    CHECK((lines == "0\n1\n" || lines == "1\n"));
  }
  CHECK(d->err().find("restart 1 of 1") != std::string::npos);
}

TEST_CASE("cluster: with --rdzv_endpoint the agents meet at an rdzvd, the driver hosts none",
          "[cluster]") {
  Cluster k(3);
  TempDir out;
  Proc rdzvd(k.net->wrap(0, {kRdzvd, "--listen", "0.0.0.0:0"}));
  REQUIRE(rdzvd.wait_output(has("listening on port"), 30s));
  const std::string banner = rdzvd.out() + rdzvd.err();
  std::smatch m;
  REQUIRE(std::regex_search(banner, m, std::regex(R"(listening on port (\d+))")));
  const std::string ep = k.net->hostname(0) + ":" + m[1].str();
  auto d = k.driver({"--hosts", "node1,node2", "--rdzv_endpoint", ep, "--rdzv_id=shared"},
                    {kWorker, "env", out.path()});
  const auto rc = d->wait(90s);
  INFO(d->err());
  CHECK(rc == 0);
  CHECK(d->err().find("hosting the rendezvous") == std::string::npos);
  for (int rank = 0; rank < 2; ++rank) {
    auto env = read_env_file(out.file("env." + std::to_string(rank)));
    CHECK(env["WORLD_SIZE"] == "2");
    CHECK(env["TORCHELASTIC_RUN_ID"] == "shared");
    CHECK(env["MUSTER_STORE_ADDR"] == "ipv4:" + k.net->addr(0) + ":" + m[1].str());
  }
  ::kill(rdzvd.pid(), SIGTERM);
  CHECK(rdzvd.wait(30s) == 0);
}

TEST_CASE("cluster: SIGINT of the launching command leaves nothing on any host", "[cluster]") {
  Cluster k(3);
  auto d = k.driver({"--hosts", "node1:2,node2:1", "--shutdown_timeout=5"}, {kWorker, "wait"});
  REQUIRE(d->wait_output(has_ready(3, "world 3"), 90s));
  const std::vector<pid_t> workers = ready_pids(d->out());
  REQUIRE(workers.size() == 3);
  REQUIRE(!k.others(1).empty());
  ::kill(d->pid(), SIGINT);
  const auto rc = d->wait(60s);
  INFO(d->err());
  CHECK(rc == 128 + SIGINT);
  for (int host : {1, 2}) CHECK(k.quiet(host, 10s));
  for (pid_t w : workers) CHECK(::kill(w, 0) != 0);
}

TEST_CASE("cluster: kill -9 of the launching command stops every host too", "[cluster]") {
  Cluster k(3);
  auto d = k.driver({"--hosts", "node1,node2"}, {kWorker, "wait"});
  REQUIRE(d->wait_output(has_ready(2, "world 2"), 90s));
  const std::vector<pid_t> workers = ready_pids(d->out());
  ::kill(d->pid(), SIGKILL);
  CHECK(d->wait(30s) == 128 + SIGKILL);
  // Its job supervisor ends the ssh clients; the sessions end, and with them the agents.
  for (int host : {1, 2}) CHECK(k.quiet(host, 15s));
  for (pid_t w : workers) CHECK(::kill(w, 0) != 0);
}

TEST_CASE("cluster: a killed ssh session stops that host, with MIN:MAX the job goes on",
          "[cluster]") {
  Cluster k(3);
  auto d = k.driver({"--hosts", "node1,node2", "--nnodes=1:2",
                     "--rdzv_conf=last_call_timeout=1"},
                    {kWorker, "wait"});
  REQUIRE(d->wait_output(has_ready(2, "world 2"), 90s));
  const pid_t ssh2 = ssh_pid(*d, "node2");
  ::kill(ssh2, SIGKILL);
  // node2's agent and worker end (their stdin, the session, ended); the driver says so, and the
  // job re-forms on node1 alone.
  CHECK(k.quiet(2, 15s));
  CHECK(d->wait_output(has("host node2 is lost"), 15s));
  CHECK(d->wait_output(has_ready(1, "world 1"), 30s));
  CHECK(d->err().find("1 of 2 hosts left, the job goes on") != std::string::npos);
  ::kill(d->pid(), SIGTERM);
  CHECK(d->wait(60s) == 128 + SIGTERM);
  CHECK(k.quiet(1, 10s));
}

TEST_CASE("cluster: a host that cannot be reached is named, too few hosts stop the job",
          "[cluster]") {
  Cluster k(4, {1, 2});  // node3 runs no sshd: its port 22 refuses
  SECTION("with MIN:MAX the others run the job") {
    TempDir out;
    auto d = k.driver({"--hosts", "node1,node2,node3", "--nnodes=2:3",
                       "--rdzv_conf=last_call_timeout=1"},
                      {kWorker, "env", out.path()});
    const auto rc = d->wait(90s);
    INFO(d->err());
    CHECK(rc == 0);
    CHECK(count_lines_with(d->err(), "host node3 is lost") == 1);
    CHECK(d->err().find("Connection refused") != std::string::npos);
    CHECK(read_env_file(out.file("env.0"))["WORLD_SIZE"] == "2");
  }
  SECTION("a login refused (an unknown user) is lost the same way") {
    TempDir out;
    auto d = k.driver({"--hosts", "node1,nosuchuser@node2", "--nnodes=1:2",
                       "--rdzv_conf=last_call_timeout=1"},
                      {kWorker, "env", out.path()});
    const auto rc = d->wait(90s);
    INFO(d->err());
    CHECK(rc == 0);
    CHECK(count_lines_with(d->err(), "host nosuchuser@node2 is lost") == 1);
    CHECK(d->err().find("Permission denied") != std::string::npos);
    CHECK(read_env_file(out.file("env.0"))["WORLD_SIZE"] == "1");
  }
  SECTION("without, one error line and nothing left running") {
    auto d = k.driver({"--hosts", "node1,node3"}, {kWorker, "wait"});
    const auto rc = d->wait(90s);
    INFO(d->err());
    CHECK(rc == 1);
    CHECK(count_lines_with(d->err(), "launch: error: host node3 is lost") == 1);
    CHECK(d->err().find("fewer than the 2 the job needs") != std::string::npos);
    CHECK(k.quiet(1, 10s));
  }
}

int main(int argc, char** argv) {
  {
    auto probe = HostNet::create(1);
    if (!probe.ok()) {
      std::printf("skipped: %s\n", std::string(probe.status().message()).c_str());
      return kSkipExit;
    }
  }
  if (::access("/usr/sbin/sshd", X_OK) != 0 || ::access("/usr/bin/ssh", X_OK) != 0) {
    std::printf("skipped: no /usr/sbin/sshd or /usr/bin/ssh (openssh-server, openssh-client)\n");
    return kSkipExit;
  }
  return catch_exit(Catch::Session().run(argc, argv));
}
