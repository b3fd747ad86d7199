// Replicated rdzvd on a real 3-member etcd cluster (support/etcd_cluster.h): two replicas, one
// leads; kill -9 of the leader while a two-agent job runs restarts no worker and spends no
// budget; etcd's own leader member may die too. Real processes on 127.0.0.1, each ended by
// its pid. Without etcd these tests report SKIPPED.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <memory>
#include <fstream>
#include <map>
#include <regex>
#include <thread>

#include "etcd_cluster.h"
#include "health_check.h"
#include "helpers.h"
#include "rdzvd_proc.h"
#include "muster/rendezvous/client.h"
#include "muster/rendezvous/grpc_store.h"
#include "certs.h"
#include "skip.h"
#include "tcpstore_client.h"

using namespace muster::testing;

namespace {

std::unique_ptr<EtcdCluster> etcd_or_skip() {
  if (const std::string why = EtcdCluster::missing(); !why.empty()) {
    report_skip(why + "; scripts/setup installs it");
    return nullptr;
  }
  return EtcdCluster::start();
}

auto says(const std::string& text) {
  return [text](const std::string& out, const std::string& err) {
    return out.find(text) != std::string::npos || err.find(text) != std::string::npos;
  };
}

// One rdzvd replica on 127.0.0.1, port 0, in etcd group `prefix`.
struct Replica {
  std::unique_ptr<Proc> proc;
  std::string endpoint;
  bool ended = false;
  Replica(const EtcdCluster& etcd, const std::string& prefix,
          const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {kRdzvd,          "--listen",      "127.0.0.1:0", "--etcd",
                                     etcd.endpoints(), "--etcd_prefix", prefix};
    argv.insert(argv.end(), extra.begin(), extra.end());
    proc = std::make_unique<Proc>(argv);
    REQUIRE(proc->wait_output(says("campaigning to lead as"), 30s));
    std::smatch m;
    const std::string out = proc->out();
    REQUIRE(std::regex_search(out, m, std::regex(R"(listening on port (\d+))")));
    endpoint = "127.0.0.1:" + m[1].str();
  }
  ~Replica() {
    if (ended) return;
    ::kill(proc->pid(), SIGTERM);
    const int rc = proc->wait(30s).value_or(-1);
    INFO("rdzvd's stderr: " << proc->err());
    CHECK(rc == 0);
  }
  bool leads(std::chrono::milliseconds timeout) {
    if (proc->wait_output(says("rdzvd: leading after"), timeout)) return true;
    // Said with the assertion that fails on it: why it did not come to lead.
    UNSCOPED_INFO("rdzvd " << endpoint << " did not lead; its output:\n"
                           << proc->out() << proc->err());
    return false;
  }
  void kill9() {
    ::kill(proc->pid(), SIGKILL);
    REQUIRE(proc->wait(10s) == 128 + SIGKILL);
    ended = true;
  }
};

std::string group_prefix(const char* test) {
  return "/muster-test/" + std::to_string(::getpid()) + "/" + test + "/";
}

// Two agents of run "job", 2 workers each (test_worker `signals`), on the replicas `list`;
// `running()` waits for round 1 and keeps pidfds of the workers, to see they outlive what
// follows.
struct TwoAgents {
  TempDir work;
  Proc a, b;
  std::vector<int> fds;
  explicit TwoAgents(const std::string& list)
      : a(launch_args(c10d(list, "2", 2, "job", conf()), {"signals", work.path()})),
        b(launch_args(c10d(list, "2", 2, "job", conf()), {"signals", work.path()})) {}
  static std::vector<std::string> conf() {
    return {"--max_restarts=2", "--rdzv_conf=reattach_timeout=20"};
  }
  void running() {
    REQUIRE(a.wait_output(has_ready(2, "world 4 round 1 restart 0"), 30s));
    REQUIRE(b.wait_output(has_ready(2, "world 4 round 1 restart 0"), 30s));
    for (Proc* p : {&a, &b}) {
      for (pid_t pid : ready_pids(p->out())) fds.push_back(open_pidfd(pid));
    }
  }
  void reattached_to(const std::string& endpoint) {
    for (Proc* p : {&a, &b}) {
      REQUIRE(p->wait_output(says("re-attached to run job round 1 at " + endpoint), 30s));
    }
  }
  // The workers of round 1 still run, each started once: nothing restarted them.
  void never_restarted() {
    for (int fd : fds) {
      CHECK_FALSE(wait_pidfd(fd, 0ms));
      ::close(fd);
    }
    fds.clear();
    for (int r = 0; r < 4; ++r) {
      INFO("rank " << r);
      REQUIRE(starts(work, r).size() == 1);
    }
  }
  // Every worker exits 0, and so do both agents.
  void finish() {
    release_workers({&a, &b});
  }
};

void check_run(const std::string& endpoint, int round, int restarts) {
  auto st = muster::rendezvous::get_status(endpoint, "job", "", 10s);
  REQUIRE(st.ok());
  REQUIRE(st->runs_size() == 1);
  CHECK(st->runs(0).phase() == "running");
  CHECK(st->runs(0).round() == round);
  CHECK(st->runs(0).restart_count() == restarts);
  CHECK(st->runs(0).members_size() == 2);
}

}  // namespace

TEST_CASE("failover: kill -9 of the leading rdzvd restarts no worker and spends no budget, a "
          "failure after costs exactly one restart",
          "[etcd][failover]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  const std::string prefix = group_prefix("kill-leader");
  auto leader = std::make_unique<Replica>(*etcd, prefix);
  REQUIRE(leader->leads(30s));
  Replica standby(*etcd, prefix);
  CHECK_FALSE(standby.leads(0ms));
  TwoAgents job(leader->endpoint + "," + standby.endpoint);
  job.running();
  // A standby is up but serves no run until it leads (its health says so).
  using Health = grpc::health::v1::HealthCheckResponse;
  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(standby.endpoint, grpc::InsecureChannelCredentials()));
  CHECK(check(*health, "") == Health::SERVING);
  CHECK(check(*health, "muster.v1.Rendezvous") == Health::NOT_SERVING);
  // It answers status calls with who leads, not with runs of its own.
  auto from_standby = muster::rendezvous::get_status(standby.endpoint, "job", "", 10s);
  CHECK(from_standby.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(from_standby.status().message()), Catch::Contains("standby"));

  leader->kill9();
  REQUIRE(standby.leads(30s));
  CHECK_THAT(standby.proc->out(), Catch::Contains("restored 1 runs from etcd"));
  CHECK(check(*health, "muster.v1.Rendezvous") == Health::SERVING);
  job.reattached_to(standby.endpoint);
  job.never_restarted();
  check_run(standby.endpoint, 1, 0);  // the budget untouched
  fail_once_then_finish(job.a, job.b, job.work);
}

TEST_CASE("failover: kill -9 of etcd's leader member: the runs go on, and are written through "
          "the other two",
          "[etcd][failover]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  const std::string prefix = group_prefix("kill-etcd");
  Replica leader(*etcd, prefix);
  REQUIRE(leader.leads(30s));
  Replica standby(*etcd, prefix);
  // The standby first: a node joining afresh is sent on to the leader it names.
  TwoAgents job(standby.endpoint + "," + leader.endpoint);
  job.running();
  const int member = etcd->leader();
  REQUIRE(member >= 0);
  etcd->kill(member);
  REQUIRE(etcd->healthy(30s));  // the other two elect a leader among them
  // The replica rode the etcd election out: it still leads (its lease was kept), and the
  // restart below is decided and written through the remaining quorum.
  check_run(leader.endpoint, 1, 0);
  job.never_restarted();
  CHECK_FALSE(standby.leads(0ms));
  fail_once_then_finish(job.a, job.b, job.work);
  CHECK(leader.proc->err().find("rdzvd: error") == std::string::npos);  // it never stopped
}

TEST_CASE("failover: SIGTERM of the leader hands over (its lease revoked), no worker restarts",
          "[etcd][failover]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  const std::string prefix = group_prefix("stop-leader");
  // Leases of a minute: a standby that leads well before one has passed can only have been
  // let in by the revocation, not by the leader's lease running out.
  const std::vector<std::string> long_lease = {"--etcd_lease_ttl", "60"};
  auto leader = std::make_unique<Replica>(*etcd, prefix, long_lease);
  REQUIRE(leader->leads(30s));
  Replica standby(*etcd, prefix, long_lease);
  TwoAgents job(leader->endpoint + "," + standby.endpoint);
  job.running();
  leader.reset();  // SIGTERM, exit 0
  REQUIRE(standby.leads(30s));  // within half the lease: it was revoked
  job.reattached_to(standby.endpoint);
  job.never_restarted();
  check_run(standby.endpoint, 1, 0);
  job.finish();
}

TEST_CASE("failover: three replicas: agents held by a standby that does not win move to the one "
          "that does",
          "[etcd][failover]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  const std::string prefix = group_prefix("three");
  auto leader = std::make_unique<Replica>(*etcd, prefix);
  REQUIRE(leader->leads(30s));
  Replica first(*etcd, prefix);
  Replica second(*etcd, prefix);  // the agents' next endpoint: holds them
  // Either standby may win: each asks etcd again every lease (a silent member must not hold
  // its campaign), and etcd's election drops a cancelled campaign's key, so the queue's order
  // is not the order of start. When the first wins, the agents held by the second move to it.
  TwoAgents job(leader->endpoint + "," + second.endpoint + "," + first.endpoint);
  job.running();
  leader->kill9();
  Replica* winner = nullptr;
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (winner == nullptr && std::chrono::steady_clock::now() < until) {
    if (first.leads(50ms)) winner = &first;
    else if (second.leads(50ms)) winner = &second;
  }
  INFO("first: " << first.proc->out() << "\nsecond: " << second.proc->out());
  REQUIRE(winner != nullptr);
  Replica& other = winner == &first ? second : first;
  job.reattached_to(winner->endpoint);
  CHECK_FALSE(other.leads(0ms));
  // The other replica saw the winner lead (and so ended the streams it held).
  const std::string port = winner->endpoint.substr(winner->endpoint.rfind(':') + 1);
  CHECK(other.proc->wait_output(says(":" + port + " leads"), 10s));
  job.never_restarted();
  check_run(winner->endpoint, 1, 0);
  job.finish();
}

TEST_CASE("failover: a worker's store client follows the failover to the new leader, the keys "
          "set before are gone",
          "[etcd][failover]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  const std::string prefix = group_prefix("store");
  auto leader = std::make_unique<Replica>(*etcd, prefix);
  REQUIRE(leader->leads(30s));
  Replica standby(*etcd, prefix);
  const std::string list = leader->endpoint + "," + standby.endpoint;
  TempDir work;
  Proc a(launch_args(c10d(list, "1", 1, "kv", {"--rdzv_conf=reattach_timeout=20"}),
                     {"signals", work.path()}));
  REQUIRE(a.wait_output(has_ready(1, "round 1"), 30s));
  // As a worker gets it: MUSTER_STORE_ADDR lists the leader first, then the other replica.
  muster::rendezvous::GrpcStore store({leader->endpoint + ";" + standby.endpoint, "kv", ""});
  REQUIRE(store.set("before", "1").ok());
  REQUIRE(store.get("before", 1s).ok());
  leader->kill9();
  auto down = store.get("before", 1s);
  CHECK(down.status().code() == absl::StatusCode::kUnavailable);
  REQUIRE(standby.leads(30s));
  REQUIRE(a.wait_output(says("re-attached to run kv round 1"), 30s));
  // The next call goes to the new leader (a call the standby answered before it led may
  // have been refused: the run was not there yet); a few, bounded.
  absl::Status st;
  const auto until = std::chrono::steady_clock::now() + 5s;
  do {
    st = store.set("after", "2");
  } while (!st.ok() && std::chrono::steady_clock::now() < until);
  REQUIRE(st.ok());
  CHECK(store.get("after", 1s).value() == "2");
  CHECK(store.get("before", 100ms).status().code() == absl::StatusCode::kDeadlineExceeded);
  release_workers({&a});
}

TEST_CASE("failover: rdzvd --etcd refuses --state_dir, and an etcd it cannot reach, in one line",
          "[etcd][failover]") {
  {
    TempDir dir;
    Proc p({kRdzvd, "--listen", "127.0.0.1:0", "--etcd", "127.0.0.1:1", "--state_dir", dir.path()});
    CHECK(p.wait(30s) == 2);
    CHECK_THAT(p.err(), Catch::StartsWith("rdzvd: error: --etcd and --state_dir exclude"));
  }
  {
    Proc p({kRdzvd, "--listen", "127.0.0.1:0", "--etcd", "not a endpoint"});
    CHECK(p.wait(30s) == 2);
    CHECK_THAT(p.err(), Catch::StartsWith("rdzvd: error: --etcd: "));
    CHECK(std::count(p.err().begin(), p.err().end(), '\n') == 1);
  }
  {
    const int port = free_port();  // nothing listens there
    Proc p({kRdzvd, "--listen", "127.0.0.1:0", "--etcd", "127.0.0.1:" + std::to_string(port)});
    CHECK(p.wait(30s) == 1);
    CHECK_THAT(p.err(), Catch::StartsWith("rdzvd: error: etcd at 127.0.0.1:"));
    CHECK(std::count(p.err().begin(), p.err().end(), '\n') == 1);
  }
}

namespace {

// VAR of process `pid`'s environment ("" when it has none).
std::string env_of(pid_t pid, const std::string& var) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::size_t at = 0;
  while (at < all.size()) {
    const std::size_t end = all.find('\0', at);
    const std::string kv = all.substr(at, end - at);
    if (kv.rfind(var + "=", 0) == 0) return kv.substr(var.size() + 1);
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return "";
}

// "rank R: pid P in place, round N": the pid of (round, rank).
std::map<std::pair<int, int>, pid_t> in_place_pids(const std::string& out) {
  std::map<std::pair<int, int>, pid_t> pids;
  static const std::regex re(R"(rank (\d+): pid (\d+) in place, round (\d+))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    pids[{std::stoi((*it)[3]), std::stoi((*it)[1])}] = std::stoi((*it)[2]);
  }
  return pids;
}

}  // namespace

// Issue 40: torch's store is the agents' in every mode, so in-place recovery works with
// replicated rdzvd, with TLS and with mutual TLS, during and right after a failover.
TEST_CASE("failover: PyTorch in place through the agents' stores: kill -9 of the leading rdzvd, "
          "then of a worker, the survivor keeps its process, a key set before is read after "
          "(plaintext, TLS, mutual TLS)",
          "[etcd][failover][torch]") {
  if (!torch_importable()) MUSTER_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  auto certs = test_certs_or_skip();
  if (!certs) return;
  for (const std::string mode : {"plaintext", "tls", "mtls"}) {
    INFO("mode " << mode);
    std::vector<std::string> server_flags;
    std::string conf = "--rdzv_conf=reattach_timeout=20";
    if (mode != "plaintext") {
      server_flags = {"--tls_cert=" + certs->server_cert, "--tls_key=" + certs->server_key};
      conf += ",tls_ca=" + certs->ca;
    }
    if (mode == "mtls") {
      server_flags.push_back("--tls_ca=" + certs->ca);
      conf += ",tls_cert=" + certs->client_cert + ",tls_key=" + certs->client_key;
    }
    const std::string prefix = group_prefix(("torch-" + mode).c_str());
    auto leader = std::make_unique<Replica>(*etcd, prefix, server_flags);
    REQUIRE(leader->leads(30s));
    Replica standby(*etcd, prefix, server_flags);
    const std::string list = leader->endpoint + "," + standby.endpoint;
    auto agent = [&] {
      std::vector<std::string> argv{kLaunch};
      for (const std::string& f : c10d(list, "2", 1, "torch-" + mode,
                                       {"--in_place", "--max_restarts=2", conf})) {
        argv.push_back(f);
      }
      for (const char* a : {"/usr/bin/python3", DDP_IN_PLACE_PY, "--steps", "400",
                            "--step-sleep-ms", "25", "--log-every", "100"}) {
        argv.push_back(a);
      }
      return argv;
    };
    const std::map<std::string, std::optional<std::string>> env{{"PYTHONPATH", std::nullopt}};
    Proc a(agent(), env), b(agent(), env);
    auto both_started = [&](int round) {
      const std::string line = "in place, round " + std::to_string(round);
      for (Proc* p : {&a, &b}) {
        if (!p->wait_output(out_has(line), 120s)) {
          FAIL("round " << round << " did not start both ranks:\n"
                        << a.out() << a.err() << b.out() << b.err());
        }
      }
      return in_place_pids(a.out() + b.out());
    };
    auto pids = both_started(1);
    const pid_t rank0 = pids.at({1, 0}), rank1 = pids.at({1, 1});
    for (pid_t p : {rank0, rank1}) {
      CHECK(env_of(p, "TORCHELASTIC_USE_AGENT_STORE") == "True");
      CHECK(env_of(p, "MASTER_ADDR") == "127.0.0.1");
    }
    const int port = std::stoi(env_of(rank0, "MASTER_PORT"));
    {
      TcpStoreClient before(port, muster::rendezvous::tcpstore::Dialect::kTorch1);
      REQUIRE(before.set("set-before-the-failover", mode));
      REQUIRE(before.get("set-before-the-failover") == mode);
    }
    leader->kill9();
    REQUIRE(standby.leads(30s));
    for (Proc* p : {&a, &b}) REQUIRE(p->wait_output(says("re-attached to run torch-" + mode), 30s));
    {
      TcpStoreClient after(port, muster::rendezvous::tcpstore::Dialect::kTorch2);
      CHECK(after.get("set-before-the-failover") == mode);
    }
    REQUIRE(::kill(rank1, SIGKILL) == 0);
    REQUIRE(a.wait(180s) == 0);
    REQUIRE(b.wait(180s) == 0);
    const std::string out = a.out() + b.out();
    // The survivor re-formed in its own process; rank 1 came back in a new one.
    CHECK(out.find("rank 0: pid " + std::to_string(rank0) + " re-formed in place as rank 0 of 2") !=
          std::string::npos);
    const auto later = in_place_pids(out);
    CHECK(later.size() == 3);
    CHECK(count_lines_with(out, "final loss") == 2);
  }
}
