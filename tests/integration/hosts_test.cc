// Multi-node jobs across real hosts: network-namespace hosts (support/hostnet.h) on one bridge,
// each with its own address, hostname and /etc/hosts, and real `launch`/`rdzvd` processes.
// Faults are the ones a cluster has: a host or link that goes silent (packets dropped, no FIN,
// no RST), a blip, a resolver that does not answer, hosts whose every core is busy.
//
// Exits 77 (ctest: Skipped) where namespaces cannot be made (not root, no `ip`).
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <regex>
#include <set>
#include <thread>

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "helpers.h"
#include "hostnet.h"
#include "proc.h"

using namespace muster::testing;

namespace {

const std::string kScripts = INTEROP_SCRIPTS_DIR;

std::unique_ptr<HostNet> make_hosts(int n) {
  auto net = HostNet::create(n);
  INFO((net.ok() ? std::string() : std::string(net.status().message())));
  REQUIRE(net.ok());
  return std::move(*net);
}

std::vector<std::string> c10d(const std::string& endpoint, const std::string& nnodes, int nproc,
                              std::vector<std::string> extra = {}) {
  std::vector<std::string> flags{"--nnodes=" + nnodes, "--nproc_per_node=" + std::to_string(nproc),
                                 "--rdzv_backend=c10d", "--rdzv_endpoint=" + endpoint,
                                 "--rdzv_id=job"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

auto has(const std::string& what) {
  return [what](const std::string&, const std::string& err) {
    return err.find(what) != std::string::npos;
  };
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

// The parameter checksums that ranks of a world of `world` printed (ddp_train.py).
std::set<std::string> checksums(const std::string& out, int world) {
  static const std::regex re(R"(rank \d+/(\d+) params_identical=True checksum=(\S+))");
  std::set<std::string> sums;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it) {
    if (std::stoi((*it)[1]) == world) sums.insert((*it)[2]);
  }
  return sums;
}

// Every launch in `ps` still runs the workers of its first round: no restart, no lost server.
void check_undisturbed(std::initializer_list<Proc*> ps) {
  for (Proc* p : ps) {
    INFO(p->err());
    CHECK(p->err().find("restarting") == std::string::npos);
    CHECK(p->err().find("lost the server") == std::string::npos);
    const std::vector<pid_t> workers = ready_pids(p->out());
    CHECK(workers.size() == 1);
    for (pid_t w : workers) CHECK(alive(w));
  }
}

// Ends a launch by its pid (SIGTERM) and checks it went as a stopped launch goes.
void stop(Proc& p) {
  ::kill(p.pid(), SIGTERM);
  CHECK(p.wait(60s) == 128 + SIGTERM);
}

// rdzvd on its own host (host `host`), ended by its pid; its endpoint by name.
struct HostRdzvd {
  std::unique_ptr<Proc> proc;
  std::string port;
  std::string endpoint;
  HostRdzvd(const HostNet& net, int host, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv{kRdzvd, "--listen", "0.0.0.0:0"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    proc = std::make_unique<Proc>(net.wrap(host, argv));
    REQUIRE(proc->wait_output(
        [](const std::string& out, const std::string&) { return out.find('\n') != std::string::npos; },
        30s));
    std::smatch m;
    REQUIRE(std::regex_search(proc->out(), m, std::regex(R"(listening on port (\d+))")));
    port = m[1].str();
    endpoint = net.hostname(host) + ":" + port;
  }
  ~HostRdzvd() {
    ::kill(proc->pid(), SIGTERM);
    CHECK(proc->wait(30s) == 0);
  }
};

}  // namespace

TEST_CASE("hosts: names, rdzvd on its own host, two agents on one host and one elsewhere",
          "[hosts]") {
  auto net = make_hosts(3);
  TempDir dir;
  HostRdzvd rdzvd(*net, 0);
  const std::string& ep = rdzvd.endpoint;
  // node1 runs two agents of one worker each, node2 one agent of two workers.
  Proc a(net->wrap(1, launch_args(c10d(ep, "3", 1), {"env", dir.path()})));
  Proc b(net->wrap(1, launch_args(c10d(ep, "3", 1), {"env", dir.path()})));
  Proc c(net->wrap(2, launch_args(c10d(ep, "3", 2), {"env", dir.path()})));
  for (Proc* p : {&a, &b, &c}) {
    const auto rc = p->wait(60s);
    INFO(p->err());
    CHECK(rc == 0);
  }
  std::set<std::string> masters;
  for (int rank = 0; rank < 4; ++rank) {
    auto env = read_env_file(dir.file("env." + std::to_string(rank)));
    INFO("rank " << rank);
    CHECK(env["WORLD_SIZE"] == "4");
    CHECK(env["GROUP_WORLD_SIZE"] == "3");
    masters.insert(env["MASTER_ADDR"] + ":" + env["MASTER_PORT"]);
    // The store is reached at an address, looked up once by the agent, never by name.
    CHECK(env["MUSTER_STORE_ADDR"] == "ipv4:" + net->addr(0) + ":" + rdzvd.port);
  }
  // MASTER_ADDR:MASTER_PORT is the run's TCPStore-protocol store (torchrun 2.x's agent store),
  // served by each worker's own agent on loopback: one listener per agent (two on node1), the
  // two workers of node2's agent on the same one.
  CHECK(masters.size() == 3);
  for (const std::string& m : masters) CHECK(m.rfind("127.0.0.1:", 0) == 0);
}

TEST_CASE("hosts: use_agent_store=false: MASTER_ADDR is the group-rank-0 node's host", "[hosts]") {
  auto net = make_hosts(3);
  TempDir dir;
  HostRdzvd rdzvd(*net, 0);
  const std::vector<std::string> conf{"--rdzv_conf=use_agent_store=false"};
  Proc a(net->wrap(1, launch_args(c10d(rdzvd.endpoint, "2", 1, conf), {"env", dir.path()})));
  Proc b(net->wrap(2, launch_args(c10d(rdzvd.endpoint, "2", 1, conf), {"env", dir.path()})));
  for (Proc* p : {&a, &b}) {
    const auto rc = p->wait(60s);
    INFO(p->err());
    CHECK(rc == 0);
  }
  std::set<std::string> masters;
  for (int rank = 0; rank < 2; ++rank) {
    auto env = read_env_file(dir.file("env." + std::to_string(rank)));
    CHECK(env["TORCHELASTIC_USE_AGENT_STORE"] == "False");
    masters.insert(env["MASTER_ADDR"]);
  }
  REQUIRE(masters.size() == 1);
  // As torchrun gives it without an agent store: the name of the group-rank-0 node's host.
  CHECK((*masters.begin() == net->hostname(1) || *masters.begin() == net->hostname(2)));
}

TEST_CASE("hosts: an IPv6 endpoint and --local_addr over IPv6", "[hosts]") {
  auto net = make_hosts(2);
  TempDir dir;
  const std::string port = std::to_string(free_port());
  const std::string ep = "[" + net->addr6(0) + "]:" + port;
  Proc a(net->wrap(0, launch_args(c10d(ep, "2", 1, {"--local_addr=" + net->addr6(0),
                                                     "--rdzv_conf=is_host=true"}),
                                  {"env", dir.path()})));
  Proc b(net->wrap(1, launch_args(c10d(ep, "2", 1, {"--local_addr=" + net->addr6(1)}),
                                  {"env", dir.path()})));
  for (Proc* p : {&a, &b}) {
    const auto rc = p->wait(60s);
    INFO(p->err());
    CHECK(rc == 0);
  }
  std::set<std::string> masters;
  int over_v6 = 0;  // the worker on host 1 reaches the store over IPv6 (host 0's: its own socket)
  for (int rank = 0; rank < 2; ++rank) {
    auto env = read_env_file(dir.file("env." + std::to_string(rank)));
    CHECK(env["WORLD_SIZE"] == "2");
    over_v6 += env["MUSTER_STORE_ADDR"] == "ipv6:[" + net->addr6(0) + "]:" + port;
    masters.insert(env["MASTER_ADDR"]);
  }
  CHECK(over_v6 == 1);
  // torch's store is each agent's, on loopback (its stream to the server goes over IPv6).
  REQUIRE(masters.size() == 1);
  CHECK(*masters.begin() == "127.0.0.1");
}

TEST_CASE("hosts: a silently partitioned host is out within the window, it rejoins when healed",
          "[hosts]") {
  auto net = make_hosts(3);
  const std::string ep = net->hostname(0) + ":" + std::to_string(free_port());
  // The default rule: 0.5 s x 4 = 2 s.
  Proc a(net->wrap(0, launch_args(c10d(ep, "2:3", 1), {"wait"})));
  Proc b(net->wrap(1, launch_args(c10d(ep, "2:3", 1), {"wait"})));
  Proc c(net->wrap(2, launch_args(c10d(ep, "2:3", 1), {"wait"})));
  for (Proc* p : {&a, &b, &c}) REQUIRE(p->wait_output(has_ready(1, "world 3"), 60s));
  const std::vector<pid_t> a_first = ready_pids(a.out());
  const std::vector<pid_t> c_workers = ready_pids(c.out());
  REQUIRE(c_workers.size() == 1);
  const int c_fd = open_pidfd(c_workers[0]);

  REQUIRE(net->cut(2).ok());
  // The survivors go on in the smaller world; the partitioned host stops its workers on its
  // own (it cannot hear the server), saying why.
  for (Proc* p : {&a, &b}) {
    const bool seen = p->wait_output(has_ready(1, "world 2"), 30s);
    INFO(p->err());
    CHECK(seen);
  }
  CHECK(wait_pidfd(c_fd, 30s));
  ::close(c_fd);
  CHECK(c.wait_output(has("nothing heard from it for 2 s"), 10s));
  CHECK(alive(c.pid()));  // not exited: it waits to join again

  REQUIRE(net->heal(2).ok());
  // The run still wants it (max 3): it joins again and the world grows back.
  for (Proc* p : {&a, &b, &c}) {
    const bool seen = p->wait_output(has_ready(2, "world 3"), 60s);
    INFO(p->err());
    CHECK(seen);
  }
  CHECK(ready_pids(a.out()).size() == a_first.size() + 2);  // world 2, then world 3 again
  for (Proc* p : {&a, &b, &c}) stop(*p);
}

TEST_CASE("hosts: a blip shorter than the run's window restarts nothing", "[hosts]") {
  auto net = make_hosts(2);
  const std::string ep = net->hostname(0) + ":" + std::to_string(free_port());
  // A 5 s window; the link is down for 2 s (with TCP's retransmission backoff the stall is
  // up to about 3 s).
  const std::vector<std::string> conf{"--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=5"};
  Proc a(net->wrap(0, launch_args(c10d(ep, "2", 1, conf), {"wait"})));
  Proc b(net->wrap(1, launch_args(c10d(ep, "2", 1, conf), {"wait"})));
  for (Proc* p : {&a, &b}) REQUIRE(p->wait_output(has_ready(1, "world 2"), 60s));
  REQUIRE(net->cut(1).ok());
  ::usleep(2'000'000);  // the blip's length is the test's input, not an event
  REQUIRE(net->heal(1).ok());
  // Nothing happens within the window and after it: no restart, no lost server.
  CHECK_FALSE(a.wait_output(has("restarting"), 7s));
  CHECK_FALSE(b.wait_output(has("lost the server"), 1s));
  check_undisturbed({&a, &b});
  for (Proc* p : {&a, &b}) stop(*p);
}

TEST_CASE("hosts: blips of 50%, 70% and 90% of the default 2 s window restart nothing",
          "[hosts][blips]") {
  // The default rule (0.5 s x 4 = 2 s), each blip cut at a random phase of the keep-alives.
  // After a silent cut TCP's retransmissions back off past the window; the probe's fresh
  // connections, and keep-alives five times an interval, are what keep the node.
  auto net = make_hosts(2);
  const std::string ep = net->hostname(0) + ":" + std::to_string(free_port());
  Proc a(net->wrap(0, launch_args(c10d(ep, "2", 1), {"wait"})));
  Proc b(net->wrap(1, launch_args(c10d(ep, "2", 1), {"wait"})));
  for (Proc* p : {&a, &b}) REQUIRE(p->wait_output(has_ready(1, "world 2"), 60s));
  const unsigned seed = std::random_device{}();
  INFO("phase seed " << seed);
  std::mt19937 rng(seed);
  for (int blip_ms : {1000, 1400, 1800}) {
    INFO("a blip of " << blip_ms << " ms");
    ::usleep(std::uniform_int_distribution<int>(0, 500'000)(rng));  // the phase: an input
    // The blip's length is the test's input, not an event: from the cut's start to the
    // heal's (each takes effect one iptables-restore into its call).
    const auto heal_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(blip_ms);
    REQUIRE(net->cut(1).ok());
    std::this_thread::sleep_until(heal_at);
    REQUIRE(net->heal(1).ok());
    // Both windows have ended within one window of the heal: nothing happened.
    CHECK_FALSE(a.wait_output(has("restarting"), 2s));
    check_undisturbed({&a, &b});
  }
  for (Proc* p : {&a, &b}) stop(*p);
}

TEST_CASE("hosts: a 17 s blip under a 60 s window restarts nothing (no fixed transport rule)",
          "[hosts][slow]") {
  // gRPC's transport keep-alive used to end the streams after 10 s + 5 s, whatever the run's
  // window: the user's rule must be the one that decides.
  auto net = make_hosts(2);
  const std::string ep = net->hostname(0) + ":" + std::to_string(free_port());
  const std::vector<std::string> conf{"--rdzv_conf=keep_alive_interval=10,keep_alive_max_attempt=6"};
  Proc a(net->wrap(0, launch_args(c10d(ep, "2", 1, conf), {"wait"})));
  Proc b(net->wrap(1, launch_args(c10d(ep, "2", 1, conf), {"wait"})));
  for (Proc* p : {&a, &b}) REQUIRE(p->wait_output(has_ready(1, "world 2"), 60s));
  REQUIRE(net->cut(1).ok());
  // The blip's length is the test's input: a silent host past the old 15 s transport rule.
  CHECK_FALSE(a.wait_output(has("restarting"), 17s));
  REQUIRE(net->heal(1).ok());
  // TCP's backoff delays the first packet through by up to ~10 s more; still inside 60 s.
  CHECK_FALSE(b.wait_output(has("lost the server"), 12s));
  check_undisturbed({&a, &b});
  for (Proc* p : {&a, &b}) stop(*p);
}

TEST_CASE("hosts: the hosting host cut off from both others trains alone (nnodes=1:3)",
          "[hosts]") {
  auto net = make_hosts(3);
  const std::string ep = net->hostname(0) + ":" + std::to_string(free_port());
  // read_timeout: how long the others try to reach their server again before they give up.
  const std::vector<std::string> conf{"--rdzv_conf=read_timeout=3"};
  Proc a(net->wrap(0, launch_args(c10d(ep, "1:3", 1, conf), {"wait"})));
  Proc b(net->wrap(1, launch_args(c10d(ep, "1:3", 1, conf), {"wait"})));
  Proc c(net->wrap(2, launch_args(c10d(ep, "1:3", 1, conf), {"wait"})));
  for (Proc* p : {&a, &b, &c}) REQUIRE(p->wait_output(has_ready(1, "world 3"), 60s));
  const std::size_t before = ready_pids(a.out()).size();
  REQUIRE(net->cut(0).ok());
  // Both peers dropped after the window; the round closes as soon as the host is back
  // alone (nobody else is expected), without waiting out a last call.
  const bool alone = a.wait_output(has_ready(1, "world 1"), 30s);
  INFO(a.err());
  CHECK(alone);
  CHECK(ready_pids(a.out()).size() == before + 1);
  for (Proc* p : {&b, &c}) {
    const auto rc = p->wait(60s);
    INFO(p->err());
    CHECK(rc == 1);
    CHECK_THAT(p->err(), Catch::Contains("could not reach it again within 3 s"));
  }
  stop(a);
}

TEST_CASE("hosts: rdzvd silent within the window costs nothing, past it the job forms again",
          "[hosts]") {
  auto net = make_hosts(3);
  HostRdzvd rdzvd(*net, 0);
  SECTION("a 2 s blip of the server under a 5 s window") {
    const std::vector<std::string> conf{"--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=5"};
    Proc a(net->wrap(1, launch_args(c10d(rdzvd.endpoint, "2", 1, conf), {"wait"})));
    Proc b(net->wrap(2, launch_args(c10d(rdzvd.endpoint, "2", 1, conf), {"wait"})));
    for (Proc* p : {&a, &b}) REQUIRE(p->wait_output(has_ready(1, "world 2"), 60s));
    REQUIRE(net->cut(0).ok());
    ::usleep(2'000'000);  // the blip's length is the test's input, not an event
    REQUIRE(net->heal(0).ok());
    CHECK_FALSE(a.wait_output(has("lost the server"), 7s));
    CHECK_FALSE(b.wait_output(has("lost the server"), 1s));
    check_undisturbed({&a, &b});
    for (Proc* p : {&a, &b}) stop(*p);
  }
  SECTION("4 s of silence under the default 2 s window") {
    Proc a(net->wrap(1, launch_args(c10d(rdzvd.endpoint, "2", 1), {"wait"})));
    Proc b(net->wrap(2, launch_args(c10d(rdzvd.endpoint, "2", 1), {"wait"})));
    for (Proc* p : {&a, &b}) REQUIRE(p->wait_output(has_ready(1, "world 2"), 60s));
    const pid_t wa = ready_pids(a.out()).at(0);
    const int fd = open_pidfd(wa);
    REQUIRE(net->cut(0).ok());
    // Each agent is out after the window: its workers stop, it waits for the server.
    CHECK(wait_pidfd(fd, 30s));
    ::close(fd);
    for (Proc* p : {&a, &b}) CHECK(p->wait_output(has("nothing heard from it for 2 s"), 10s));
    REQUIRE(net->heal(0).ok());
    // Both reach it again; the server had dropped the run (no node left), so they form it
    // anew: the workers start again in a world of two.
    for (Proc* p : {&a, &b}) {
      const bool seen = p->wait_output(has_ready(2, "world 2"), 60s);
      INFO(p->err());
      CHECK(seen);
    }
    for (Proc* p : {&a, &b}) stop(*p);
  }
}

TEST_CASE("hosts: hosts whose every core is busy for a minute are not declared dead",
          "[hosts][slow]") {
  auto net = make_hosts(3);
  const std::string ep = net->hostname(0) + ":" + std::to_string(free_port());
  // Two busy workers per host on this machine's cores (six on two cores here), default rule.
  const int cores = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  Proc a(net->wrap(0, launch_args(c10d(ep, "3", cores), {"burn", "60"})));
  Proc b(net->wrap(1, launch_args(c10d(ep, "3", cores), {"burn", "60"})));
  Proc c(net->wrap(2, launch_args(c10d(ep, "3", cores), {"burn", "60"})));
  for (Proc* p : {&a, &b, &c}) {
    const auto rc = p->wait(180s);
    INFO(p->err());
    CHECK(rc == 0);
    CHECK(p->err().find("restarting") == std::string::npos);
    CHECK(p->err().find("lost the server") == std::string::npos);
    CHECK(ready_pids(p->out()).size() == static_cast<std::size_t>(cores));  // one round only
  }
}

TEST_CASE("hosts: a resolver that does not answer costs nothing for names in /etc/hosts",
          "[hosts]") {
  auto net = make_hosts(3);
  // The resolver is host 2's address, and host 2 is cut off: queries to it go unanswered.
  REQUIRE(net->cut(2).ok());
  for (int i : {0, 1}) REQUIRE(net->set_resolver(i, net->addr(2)).ok());
  TempDir dir;
  const std::string ep = net->hostname(0) + ":" + std::to_string(free_port());
  Proc a(net->wrap(0, launch_args(c10d(ep, "2", 1), {"env", dir.path()})));
  Proc b(net->wrap(1, launch_args(c10d(ep, "2", 1), {"env", dir.path()})));
  // gRPC's own resolver asked DNS for the other address family and took over a minute here.
  for (Proc* p : {&a, &b}) {
    const auto rc = p->wait(20s);
    INFO(p->err());
    CHECK(rc == 0);
  }
  // A name that only DNS could answer: one clear line, exit 1, within the resolve bound
  // (glibc's own timeouts, 5 s x 2, end about when the bound does: either error may come).
  Proc lost(net->wrap(1, launch_args(c10d("nosuchhost:29400", "2", 1), {"env", dir.path()})));
  const auto rc = lost.wait(40s);
  INFO(lost.err());
  CHECK(rc == 1);
  CHECK_THAT(lost.err(), Catch::Contains("cannot resolve 'nosuchhost'"));
  CHECK(std::count(lost.err().begin(), lost.err().end(), '\n') == 1);
}

TEST_CASE("hosts: PyTorch DDP across two hosts", "[hosts][interop]") {
  auto net = make_hosts(2);
  const std::string ep = net->hostname(0) + ":" + std::to_string(free_port());
  const std::map<std::string, std::optional<std::string>> env{{"PYTHON_EXEC", "/usr/bin/python3"}};
  auto args = [&] {
    return std::vector<std::string>{kLaunch, "--nnodes=2", "--nproc_per_node=1",
                                    "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep,
                                    "--rdzv_id=ddp", kScripts + "/ddp_train.py"};
  };
  Proc a(net->wrap(0, args()), env);
  Proc b(net->wrap(1, args()), env);
  for (Proc* p : {&a, &b}) {
    const auto rc = p->wait(300s);
    INFO(p->err());
    REQUIRE(rc == 0);
  }
  const std::string out = a.out() + b.out();
  CHECK(count_lines_with(out, "params_identical=True") == 2);
  CHECK(count_lines_with(out, "agent_store=True") == 2);  // the hosting agent's run store
  CHECK(checksums(out, 2).size() == 1);
}

namespace {

// Issue 38: three hosts, one rank each, train `ddp_train.py` (elastic) in a world of 3 until the test
// takes hosts away; a world of `finish_world` ranks trains 10 steps and ends.
struct TorchHosts {
  std::unique_ptr<HostNet> net = make_hosts(3);
  std::string ep = net->hostname(0) + ":" + std::to_string(free_port());
  std::vector<std::unique_ptr<Proc>> hosts;
  explicit TorchHosts(int finish_world) {
    const std::map<std::string, std::optional<std::string>> env{{"PYTHON_EXEC", "/usr/bin/python3"}};
    for (int h = 0; h < 3; ++h) {
      std::vector<std::string> argv{kLaunch};
      for (const std::string& f : c10d(ep, "1:3", 1)) argv.push_back(f);
      argv.insert(argv.end(), {kScripts + "/ddp_train.py", "10",
                               "--finish_world=" + std::to_string(finish_world)});
      hosts.push_back(std::make_unique<Proc>(net->wrap(h, argv), env));
    }
    for (auto& p : hosts) {
      const bool training = p->wait_output(
          [](const std::string& out, const std::string&) { return out.find("/3 step 3 ") != std::string::npos; },
          180s);
      INFO(p->out() << p->err());
      REQUIRE(training);
    }
  }
  // Every host in `survivors` exits 0 after its rank finished in a world of `world`, with the
  // others' parameters, at the same restart count (no restart was counted: max_restarts=0).
  void check_survivors(std::initializer_list<int> survivors, int world) {
    std::string all;
    for (int h : survivors) {
      Proc& p = *hosts[static_cast<std::size_t>(h)];
      const auto rc = p.wait(300s);
      INFO("host " << h << "\n" << p.out() << p.err());
      REQUIRE(rc == 0);
      CHECK(count_lines_with(p.out(), "/" + std::to_string(world) + " params_identical=True") == 1);
      CHECK(count_lines_with(p.out(), " steps=10") == 1);
      CHECK_THAT(p.out(), !Catch::Contains("joined attempt=1"));
      all += p.out();
    }
    CHECK(checksums(all, world).size() == 1);
  }
};

}  // namespace

TEST_CASE("hosts: PyTorch, kill -9 of one host of three: the other two train on in a world of 2",
          "[hosts][torch_leave]") {
  if (!torch_importable()) MUSTER_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  TorchHosts t(2);
  ::kill(t.hosts[1]->pid(), SIGKILL);
  CHECK(t.hosts[1]->wait(60s) == 128 + SIGKILL);
  t.check_survivors({0, 2}, 2);
}

TEST_CASE("hosts: PyTorch, kill -9 of two hosts of three: the last trains on alone",
          "[hosts][torch_leave]") {
  if (!torch_importable()) MUSTER_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  TorchHosts t(1);
  ::kill(t.hosts[1]->pid(), SIGKILL);
  ::kill(t.hosts[2]->pid(), SIGKILL);
  for (int h : {1, 2}) CHECK(t.hosts[static_cast<std::size_t>(h)]->wait(60s) == 128 + SIGKILL);
  t.check_survivors({0}, 1);
}

TEST_CASE("hosts: PyTorch, a host cut off silently: the other two train on in a world of 2",
          "[hosts][torch_leave]") {
  if (!torch_importable()) MUSTER_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  TorchHosts t(2);
  REQUIRE(t.net->cut(2).ok());
  t.check_survivors({0, 1}, 2);
  REQUIRE(t.net->heal(2).ok());
  stop(*t.hosts[2]);
}

TEST_CASE("hosts: PyTorch in place with --spares, a joining host cut off silently: the other two "
          "train on in their own processes in a world of 2",
          "[hosts][torch_leave][silent_join]") {
  if (!torch_importable()) MUSTER_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  auto net = make_hosts(4);
  HostRdzvd rdzvd(*net, 0);
  const std::map<std::string, std::optional<std::string>> env{{"PYTHONPATH", std::nullopt},
                                                              {"MUSTER_LOG_LEVEL", "info"}};
  auto agent = [&](int h) {
    std::vector<std::string> argv{kLaunch};
    for (const std::string& f : c10d(rdzvd.endpoint, "2:3", 1,
                                     {"--rdzv_conf=last_call_timeout=0.5", "--in_place", "--spares=1",
                                      "--max_restarts=2"})) {
      argv.push_back(f);
    }
    argv.insert(argv.end(), {"/usr/bin/python3", kScripts + "/../../examples/python/ddp_in_place.py", "--steps", "1000000",
                             "--log-every", "100", "--step-sleep-ms", "10"});
    return std::make_unique<Proc>(net->wrap(h, argv), env);
  };
  auto a = agent(1), b = agent(2);
  auto said = [](const std::string& what) {
    return [what](const std::string& out, const std::string&) { return out.find(what) != std::string::npos; };
  };
  for (Proc* p : {a.get(), b.get()}) {
    const bool formed = p->wait_output(said("in place, round 1"), 120s);
    INFO(p->out() << p->err());
    REQUIRE(formed);
  }
  // Host 3 joins; once its warm worker is given its rank (the round with it formed, the
  // worker joining the others' group), every packet to and from it is dropped.
  auto c = agent(3);
  REQUIRE(c->wait_output([](const std::string&, const std::string& err) {
    return err.find("takes local rank 0") != std::string::npos;
  }, 120s));
  REQUIRE(net->cut(3).ok());
  // Each survivor re-forms into a world of 2 in a round after the one with host 3; or, where
  // gloo left its collective blocked after the abort (docs/in_place_torch.md, "A collective
  // the abort cannot end"), it says it gave up and its rank starts anew in such a round.
  static const std::regex again(
      R"((?:: pid \d+ re-formed in place as rank (\d) of 2, round (\d+))|(?:rank (\d): pid \d+ in place, round (\d+)))");
  // The rank a survivor's process holds now, once it is in a world of 2 (-1 before).
  auto rank_in_2 = [](const std::string& out, const std::string& err) {
    int rank = -1;
    for (auto it = std::sregex_iterator(out.begin(), out.end(), again); it != std::sregex_iterator(); ++it) {
      const bool reformed = (*it)[1].matched;
      const int round = std::stoi((*it)[reformed ? 2 : 4]);
      if (round < 3) continue;
      if (!reformed && (out + err).find("still blocked") == std::string::npos) continue;
      rank = std::stoi((*it)[reformed ? 1 : 3]);
    }
    return rank;
  };
  for (Proc* p : {a.get(), b.get()}) {
    const bool ok = p->wait_output(
        [&](const std::string& out, const std::string& err) { return rank_in_2(out, err) >= 0; }, 120s);
    INFO(p->out() << p->err());
    REQUIRE(ok);
  }
  // They train on: rank 0 of the world of 2 logs a step 200 beyond the last logged before.
  Proc* rank0 = rank_in_2(a->out(), a->err()) == 0 ? a.get() : b.get();
  static const std::regex step(R"(step (\d+): loss)");
  int last = -1;
  const std::string both = a->out() + b->out();
  for (auto it = std::sregex_iterator(both.begin(), both.end(), step); it != std::sregex_iterator(); ++it) {
    last = std::max(last, std::stoi((*it)[1]));
  }
  REQUIRE(rank0->wait_output(said("step " + std::to_string(last + 200 - (last + 200) % 100) + ": loss"), 120s));
  REQUIRE(net->heal(3).ok());
  for (Proc* p : {a.get(), b.get(), c.get()}) ::kill(p->pid(), SIGTERM);
  std::set<std::string> params;
  for (Proc* p : {a.get(), b.get()}) {
    const auto rc = p->wait(60s);
    INFO(p->out() << p->err());
    CHECK(rc == 128 + SIGTERM);
    // One process all along: the pid of every re-form is the one that started.
    std::set<std::string> pids;
    const std::string out = p->out();
    static const std::regex pid(R"(: pid (\d+) (?:in place|re-formed))");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), pid); it != std::sregex_iterator(); ++it) {
      pids.insert((*it)[1]);
    }
    // (two: it gave up a blocked collective, said so, and its rank started anew; the new
    // process took the other's state, and has no re-form of its own to print a digest at)
    const bool gave_up = (out + p->err()).find("still blocked") != std::string::npos;
    CHECK(pids.size() == (gave_up ? 2u : 1u));
    if (gave_up) continue;
    std::string digest;
    static const std::regex round_params(R"(round (\d+) params (\S+))");
    int best = -1;
    for (auto it = std::sregex_iterator(out.begin(), out.end(), round_params); it != std::sregex_iterator(); ++it) {
      if (std::stoi((*it)[1]) > best) {
        best = std::stoi((*it)[1]);
        digest = (*it)[2];
      }
    }
    params.insert(std::to_string(best) + " " + digest);
  }
  c->wait(60s);
  // Both survivors hold the same parameters after their last re-form.
  CHECK(params.size() == 1);
}

int main(int argc, char** argv) {
  {
    auto probe = HostNet::create(1);
    if (!probe.ok()) {
      std::printf("skipped: %s\n", std::string(probe.status().message()).c_str());
      return kSkipExit;
    }
  }
  return catch_exit(Catch::Session().run(argc, argv));
}

// launch --preflight (docs/stragglers.md, "Pre-flight"): three agents on hosts whose links are
// capped by tbf on both ends of their veths. All at 400 Mbit/s: nobody is named and the
// world is three. One of them at 80 Mbit/s (a fifth): that node is named in one line and
// exits 1 before its workers start, the other two run their workers in a world of two.
TEST_CASE("hosts: pre-flight probes name a host whose link is capped to a fifth of the others'",
          "[hosts][capped_link]") {
  auto net = make_hosts(4);
  HostRdzvd rdzvd(*net, 0);
  for (int h : {1, 2, 3}) REQUIRE(net->rate_limit(h, 400'000).ok());
  auto job = [&](const std::string& dir, const std::string& id) {
    std::vector<std::unique_ptr<Proc>> agents;
    for (int h : {1, 2, 3}) {
      std::vector<std::string> argv{"env", "MUSTER_LOG_LEVEL=info"};
      for (std::string& a : launch_args({"--nnodes=2:3", "--nproc_per_node=1",
                                         "--rdzv_backend=c10d",
                                         "--rdzv_endpoint=" + rdzvd.endpoint, "--rdzv_id=" + id,
                                         "--preflight"},
                                        {"env", dir})) {
        argv.push_back(std::move(a));
      }
      agents.push_back(std::make_unique<Proc>(net->wrap(h, argv)));
    }
    return agents;
  };
  {
    TempDir dir;
    auto agents = job(dir.path(), "even");
    for (auto& a : agents) {
      CHECK(a->wait(60s) == 0);
      INFO(a->err());
      CHECK(a->err().find("pre-flight: this node's link") != std::string::npos);
      CHECK(a->err().find("pre-flight failed") == std::string::npos);
    }
    for (int r = 0; r < 3; ++r) {
      CHECK(read_env_file(dir.path() + "/env." + std::to_string(r))["WORLD_SIZE"] == "3");
    }
  }
  REQUIRE(net->rate_limit(3, 80'000).ok());
  {
    TempDir dir;
    auto agents = job(dir.path(), "capped");
    Proc& slow = *agents[2];
    CHECK(slow.wait(60s) == 1);
    INFO(slow.err());
    CHECK(slow.err().find("pre-flight failed on node3: its link moved") != std::string::npos);
    CHECK(!std::filesystem::exists(dir.path() + "/env.2"));
    for (int i : {0, 1}) {
      CHECK(agents[i]->wait(60s) == 0);
      INFO(agents[i]->err());
      CHECK(agents[i]->err().find("leaves the run; waiting for the round without it") !=
            std::string::npos);
    }
    for (int r = 0; r < 2; ++r) {
      const auto env = read_env_file(dir.path() + "/env." + std::to_string(r));
      CHECK(env.at("WORLD_SIZE") == "2");
    }
  }
}

// The straggler watch's slow links (docs/stragglers.md, "Slow links"): a PyTorch DDP job of
// three hosts whose links tbf caps at 400 Mbit/s, one at 80 Mbit/s; the ranks' own work is
// alike, their collectives wait alike, and the capped host is named with cause network from
// its connections' rates.
TEST_CASE("hosts: a host whose link is capped to a fifth of the others' is named as a network "
          "straggler while the job runs",
          "[hosts][capped_link]") {
  if (!torch_importable()) MUSTER_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  auto net = make_hosts(4);
  HostRdzvd rdzvd(*net, 0, {"--event_log", "-"});
  for (int h : {1, 2}) REQUIRE(net->rate_limit(h, 400'000).ok());
  REQUIRE(net->rate_limit(3, 80'000).ok());
  const std::map<std::string, std::optional<std::string>> env{{"PYTHONPATH", std::nullopt}};
  std::vector<std::unique_ptr<Proc>> agents;
  for (int h : {1, 2, 3}) {
    agents.push_back(std::make_unique<Proc>(
        net->wrap(h, {kLaunch, "--nnodes=3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                      "--rdzv_endpoint=" + rdzvd.endpoint, "--rdzv_id=links",
                      "--watch_stragglers", kScripts + "/../../examples/python/ddp_in_place.py",
                      "--steps", "1000000", "--hidden", "1024", "--step-sleep-ms", "30",
                      "--log-every", "10"}),
        env));
  }
  // A name for a slow link (this machine's two cores may also name a rank whose CPU share is
  // smaller, as compute: not what this test is about).
  static const std::regex network(R"re("event":"straggler_named".*"host":"([^"]*)".*"cause":"network")re");
  const bool named = rdzvd.proc->wait_output(
      [](const std::string&, const std::string& err) {
        return std::regex_search(err, network);
      },
      120s);
  INFO("rdzvd's event log:\n" << rdzvd.proc->err());
  for (auto& a : agents) ::kill(a->pid(), SIGTERM);
  for (auto& a : agents) a->wait(60s);
  REQUIRE(named);
  // Only node3, however many times.
  const std::string log = rdzvd.proc->err();
  std::set<std::string> hosts;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), network); it != std::sregex_iterator();
       ++it) {
    hosts.insert((*it)[1]);
  }
  CHECK(hosts == std::set<std::string>{"node3"});
}
