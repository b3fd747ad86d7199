// TLS and per-run credentials against real rdzvd and launch processes on 127.0.0.1
// (docs/operations.md): what a TLS server refuses, mutual TLS, whole jobs over TLS, and run
// tokens (a token file, reloaded on SIGHUP). Certificates are made by tests/support/certs.h
// with the openssl command; without one these tests report SKIPPED.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <memory>
#include <regex>

#include "certs.h"
#include "held_run.h"
#include "helpers.h"
#include "rdzvd_proc.h"
#include "skip.h"
#include "tcpstore_client.h"
#include "muster/rendezvous/client.h"
#include "muster/rendezvous/grpc_store.h"
#include "muster/rendezvous/server.h"
#include "muster/rendezvous/tls.h"

using namespace muster::testing;
namespace rdzv = muster::rendezvous;

namespace {

const std::string kCollective = COLLECTIVE_WORKER_BIN;

std::unique_ptr<TestCerts> certs() {
  rdzv::route_grpc_logs_to_spdlog();  // the refused handshakes of this process's clients
  return test_certs_or_skip();
}


rdzv::ClientTls client_tls(const std::string& ca, const std::string& cert = "",
                           const std::string& key = "", const std::string& name = "") {
  auto tls = rdzv::load_client_tls({ca, cert, key, name});
  REQUIRE(tls.ok());
  return *tls;
}

absl::Status status_call(const std::string& ep, const rdzv::ClientTls& tls,
                         const std::string& run = "", const std::string& token = "") {
  return rdzv::get_status(ep, run, token, 10s, tls).status();
}

std::vector<std::string> agent(const std::string& ep, const std::string& nnodes, int nproc,
                               const std::string& id, const std::string& conf,
                               std::vector<std::string> program) {
  std::vector<std::string> argv{kLaunch,
                                "--nnodes=" + nnodes,
                                "--nproc_per_node=" + std::to_string(nproc),
                                "--rdzv_backend=c10d",
                                "--rdzv_endpoint=" + ep,
                                "--rdzv_id=" + id,
                                "--local_addr=127.0.0.1"};
  if (!conf.empty()) argv.push_back("--rdzv_conf=" + conf);
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

std::string tls_conf(const TestCerts& c, bool client_cert) {
  std::string conf = "tls_ca=" + c.ca;
  if (client_cert) conf += ",tls_cert=" + c.client_cert + ",tls_key=" + c.client_key;
  return conf;
}

}  // namespace

TEST_CASE("security: a TLS rdzvd refuses plaintext, a wrong CA and a wrong name, its CA is accepted",
          "[security][tls]") {
  auto c = certs();
  if (!c) return;
  RdzvdProc server({"--tls_cert", c->server_cert, "--tls_key", c->server_key});
  CHECK(status_call(server.endpoint, {}).code() == absl::StatusCode::kUnavailable);
  CHECK(status_call(server.endpoint, client_tls(c->other_ca)).code() ==
        absl::StatusCode::kUnavailable);
  CHECK(status_call(server.endpoint, client_tls(c->ca, "", "", "rdzv.example")).code() ==
        absl::StatusCode::kUnavailable);
  CHECK(status_call(server.endpoint, client_tls(c->ca)).ok());  // IP:127.0.0.1 in the cert
  CHECK(status_call(server.endpoint, client_tls(c->ca, "", "", "localhost")).ok());

  // Agents: plaintext, or a CA that did not sign the server's certificate, never get in.
  Proc plain(agent(server.endpoint, "1", 1, "job", "read_timeout=2", {kWorker, "die", "0"}));
  Proc wrong(agent(server.endpoint, "1", 1, "job", "read_timeout=2,tls_ca=" + c->other_ca,
                   {kWorker, "die", "0"}));
  CHECK(plain.wait() == 1);
  CHECK(wrong.wait() == 1);
  CHECK_THAT(plain.err(), Catch::Contains("not reachable within 2 s"));
  CHECK_THAT(wrong.err(), Catch::Contains("not reachable within 2 s"));
  CHECK_THAT(wrong.err(), Catch::Contains("certificate verify failed"));  // gRPC's last error
}

TEST_CASE("security: rdzvd status and launch status over mutual TLS", "[security][tls][status]") {
  auto c = certs();
  if (!c) return;
  RdzvdProc server({"--tls_cert", c->server_cert, "--tls_key", c->server_key, "--tls_ca", c->ca});
  Proc plain({kRdzvd, "status", "--endpoint", server.endpoint});
  CHECK(plain.wait(30s) == 1);
  CHECK_THAT(plain.err(), Catch::StartsWith("rdzvd: error: "));
  CHECK(std::count(plain.err().begin(), plain.err().end(), '\n') == 1);
  Proc no_cert({kRdzvd, "status", "--endpoint", server.endpoint, "--tls_ca", c->ca});
  CHECK(no_cert.wait(30s) == 1);  // mutual TLS: a client certificate is required
  Proc ok({kRdzvd, "status", "--endpoint", server.endpoint, "--tls_ca", c->ca, "--tls_cert",
           c->client_cert, "--tls_key", c->client_key});
  CHECK(ok.wait(30s) == 0);
  CHECK(ok.out() == "no runs\n");
  // launch status takes the same files from the MUSTER_TLS_* variables too.
  Proc via_env({kLaunch, "status", "--rdzv_endpoint", server.endpoint, "--json"},
               {{"MUSTER_TLS_CA", c->ca}, {"MUSTER_TLS_CERT", c->client_cert},
                   {"MUSTER_TLS_KEY", c->client_key}});
  CHECK(via_env.wait(30s) == 0);
  CHECK_THAT(via_env.out(), Catch::StartsWith("{"));
  Proc bad({kLaunch, "status", "--rdzv_endpoint", server.endpoint, "--tls_ca", "/nonexistent"});
  CHECK(bad.wait(30s) == 2);
  CHECK_THAT(bad.err(), Catch::Contains("/nonexistent"));
}

TEST_CASE("security: a server certificate that has expired is refused", "[security][tls]") {
  auto c = certs();
  if (!c) return;
  // rdzvd will not serve it: exit 2, one line naming the file.
  Proc d({kRdzvd, "--listen", "127.0.0.1:0", "--tls_cert", c->expired_cert, "--tls_key",
          c->expired_key});
  CHECK(d.wait() == 2);
  CHECK(d.err() == "rdzvd: error: --tls_cert " + c->expired_cert +
                       ": the certificate expired on Jan  2 00:00:00 2020 GMT\n");
  // A server that does (its files read past that check) is refused by the client.
  boost::asio::io_context io;
  rdzv::ServerOptions opts;
  opts.tls.cert_pem = read_file(c->expired_cert);
  opts.tls.key_pem = read_file(c->expired_key);
  auto server = rdzv::RendezvousServer::start(io, opts);
  REQUIRE(server.ok());
  const std::string ep = "127.0.0.1:" + std::to_string((*server)->port());
  CHECK(status_call(ep, client_tls(c->ca)).code() == absl::StatusCode::kUnavailable);
  (*server)->shutdown();
}

TEST_CASE("security: rdzvd's bad TLS files are one usage error line", "[security][tls]") {
  auto c = certs();
  if (!c) return;
  auto run = [](std::vector<std::string> flags) {
    std::vector<std::string> argv{kRdzvd, "--listen", "127.0.0.1:0"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    Proc p(argv);
    CHECK(p.wait() == 2);
    CHECK(p.out().empty());
    return p.err();
  };
  CHECK(run({"--tls_cert", c->server_cert}) ==
        "rdzvd: error: --tls_cert and --tls_key go together: give both\n");
  CHECK(run({"--tls_cert", c->server_cert, "--tls_key", c->client_key}) ==
        "rdzvd: error: --tls_key " + c->client_key + ": is not the key of --tls_cert " +
            c->server_cert + "\n");
  CHECK(run({"--tls_cert", c->dir.file("nope"), "--tls_key", c->server_key}) ==
        "rdzvd: error: --tls_cert " + c->dir.file("nope") +
            ": cannot read it (No such file or directory)\n");
}

TEST_CASE("security: mutual TLS: no client certificate, or one of another CA, is refused",
          "[security][tls]") {
  auto c = certs();
  if (!c) return;
  RdzvdProc server({"--tls_cert", c->server_cert, "--tls_key", c->server_key, "--tls_ca", c->ca});
  CHECK(status_call(server.endpoint, client_tls(c->ca)).code() == absl::StatusCode::kUnavailable);
  CHECK(status_call(server.endpoint, client_tls(c->ca, c->other_client_cert, c->other_client_key))
            .code() == absl::StatusCode::kUnavailable);
  CHECK(status_call(server.endpoint, client_tls(c->ca, c->client_cert, c->client_key)).ok());

  Proc without(agent(server.endpoint, "1", 1, "job", "read_timeout=2," + tls_conf(*c, false),
                     {kWorker, "die", "0"}));
  CHECK(without.wait() == 1);
  CHECK_THAT(without.err(), Catch::Contains("not reachable within 2 s"));
  Proc with(agent(server.endpoint, "1", 1, "job", tls_conf(*c, true), {kWorker, "die", "0"}));
  CHECK(with.wait() == 0);
}

TEST_CASE("security: a two-node job over mutual TLS: agents and workers (store, ring) with rdzvd",
          "[security][tls]") {
  auto c = certs();
  if (!c) return;
  RdzvdProc server({"--tls_cert", c->server_cert, "--tls_key", c->server_key, "--tls_ca", c->ca});
  // The workers' store client must verify the server and show the client certificate too:
  // there is no plaintext local listener to fall back to.
  Proc a(agent(server.endpoint, "2", 2, "tls-job", tls_conf(*c, true), {kCollective, "sum"}));
  Proc b(agent(server.endpoint, "2", 2, "tls-job", tls_conf(*c, true), {kCollective, "sum"}));
  REQUIRE(a.wait() == 0);
  REQUIRE(b.wait() == 0);
  CHECK(count_lines_with(a.out() + b.out(), "sum correct") == 4);
}

TEST_CASE("security: a hosting launch serves TLS to its own agent, another agent and the workers",
          "[security][tls]") {
  auto c = certs();
  if (!c) return;
  TempDir dir;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::vector<std::string> server_flags{"--tls_cert=" + c->server_cert,
                                              "--tls_key=" + c->server_key, "--tls_ca=" + c->ca};
  auto hosting = [&](std::vector<std::string> program) {
    std::vector<std::string> argv = agent(ep, "2", 1, "hosted", tls_conf(*c, true), {});
    argv.insert(argv.end(), server_flags.begin(), server_flags.end());
    argv.insert(argv.end(), program.begin(), program.end());
    return argv;
  };
  {
    // Either may host (the one that binds the port first): both have the server's flags.
    // The second agent's own settings come from the MUSTER_TLS_* variables.
    std::vector<std::string> second = agent(ep, "2", 1, "hosted", "", {});
    second.insert(second.end(), server_flags.begin(), server_flags.end());
    second.insert(second.end(), {kCollective, "sum"});
    Proc a(hosting({kCollective, "sum"}));
    Proc b(second, {{"MUSTER_TLS_CA", c->ca}, {"MUSTER_TLS_CERT", c->client_cert},
                    {"MUSTER_TLS_KEY", c->client_key}});
    REQUIRE(a.wait() == 0);
    REQUIRE(b.wait() == 0);
    CHECK(count_lines_with(a.out() + b.out(), "sum correct") == 2);
  }
  // What the workers were given: the agent's files, the endpoint's host as the name to
  // check, and the store over TCP (never the plaintext Unix-domain socket).
  const std::string ep2 = "127.0.0.1:" + std::to_string(free_port());
  std::vector<std::string> argv = agent(ep2, "1", 1, "hosted-env", tls_conf(*c, true), {});
  argv.insert(argv.end(), server_flags.begin(), server_flags.end());
  argv.insert(argv.end(), {kWorker, "env", dir.path()});
  Proc one(argv);
  REQUIRE(one.wait() == 0);
  auto env = read_env_file(dir.file("env.0"));
  CHECK(env["MUSTER_TLS_CA"] == c->ca);
  CHECK(env["MUSTER_TLS_CERT"] == c->client_cert);
  CHECK(env["MUSTER_TLS_KEY"] == c->client_key);
  CHECK(env["MUSTER_TLS_SERVER_NAME"] == "127.0.0.1");
  CHECK(env["MUSTER_STORE_ADDR"].rfind("unix-abstract:", 0) == std::string::npos);
  // torch's store is the agent's, on loopback, relayed over the agent's TLS stream.
  CHECK(env["TORCHELASTIC_USE_AGENT_STORE"] == "True");
  CHECK(env["MASTER_ADDR"] == "127.0.0.1");
}

TEST_CASE("security: --standalone with TLS: the embedded server and its workers", "[security][tls]") {
  auto c = certs();
  if (!c) return;
  Proc p({kLaunch, "--standalone", "--nproc_per_node=2", "--tls_cert=" + c->server_cert,
          "--tls_key=" + c->server_key, "--rdzv_conf=tls_ca=" + c->ca, kCollective, "sum"});
  REQUIRE(p.wait() == 0);
  CHECK(count_lines_with(p.out(), "sum correct") == 2);
  Proc bad({kLaunch, "--standalone", "--tls_cert=" + c->server_cert, "--tls_key=" + c->server_key,
            kCollective, "sum"});
  CHECK(bad.wait() == 2);
  CHECK(bad.err() ==
        "launch: error: --tls_cert: the agents verify the server they reach, this launch's own "
        "too: give --rdzv_conf tls_ca=CA_FILE (or MUSTER_TLS_CA)\n");
}

TEST_CASE("security: per-run tokens: one run's token joins, reads and watches no other run",
          "[security][tokens]") {
  TempDir dir;
  std::ofstream(dir.file("tokens")) << "# run token\nrun-a token-a\nrun-b token-b\n";
  RdzvdProc server({"--token_file", dir.file("tokens"), "--token", "shared"});
  // Run b is held open by a session with its own token, so its table exists.
  HeldRun b(server.endpoint, "run-b", 1, 1, "token-b");

  // Joins: run a's token, and the shared one, are refused for run b.
  for (const std::string token : {"token-a", "shared"}) {
    Proc p(agent(server.endpoint, "1", 1, "run-b", "token=" + token, {kWorker, "die", "0"}));
    CHECK(p.wait() == 1);
    CHECK_THAT(p.err(), Catch::Contains("wrong or missing token for this run"));
  }
  // The store: run a's token on run b's table.
  auto store = [&](const std::string& run, const std::string& token) {
    rdzv::GrpcStoreOptions o;
    o.target = server.endpoint;
    o.run_id = run;
    o.token = token;
    return std::make_unique<rdzv::GrpcStore>(o);
  };
  auto intruder = store("run-b", "token-a");
  CHECK(intruder->set("k", "v").code() == absl::StatusCode::kPermissionDenied);
  CHECK(intruder->num_keys().status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(store("run-b", "shared")->num_keys().status().code() == absl::StatusCode::kPermissionDenied);
  auto owner = store("run-b", "token-b");
  REQUIRE(owner->set("k", "v").ok());
  CHECK(*owner->num_keys() == 1);
  // Status: of run b with its token only; of every run with the shared token only.
  CHECK(status_call(server.endpoint, {}, "run-b", "token-a").code() ==
        absl::StatusCode::kPermissionDenied);
  CHECK(status_call(server.endpoint, {}, "run-b", "token-b").ok());
  CHECK(status_call(server.endpoint, {}, "", "token-b").code() == absl::StatusCode::kPermissionDenied);
  CHECK(status_call(server.endpoint, {}, "", "shared").ok());
  // A run not in the file: the shared token.
  Proc other(agent(server.endpoint, "1", 1, "run-c", "token=shared", {kWorker, "die", "0"}));
  CHECK(other.wait() == 0);
}

TEST_CASE("security: a token file without a shared token, SIGHUP adds a run, a bad file is kept out",
          "[security][tokens]") {
  TempDir dir;
  const std::string file = dir.file("tokens");
  std::ofstream(file) << "run-a token-a\n";
  // A finished run's id is free again at once: the same run is joined several times.
  RdzvdProc server({"--token_file", file, "--finished_run_grace=0"});
  std::string err;
  auto join = [&](const std::string& run, const std::string& token) {
    Proc p(agent(server.endpoint, "1", 1, run, "token=" + token, {kWorker, "die", "0"}));
    const auto code = p.wait();
    err = p.err();
    return code;
  };
  const std::string refused = "wrong or missing token for this run";
  CHECK(join("run-c", "token-c") == 1);  // not listed, and no shared token
  CHECK_THAT(err, Catch::Contains(refused));
  CHECK(join("run-c", "") == 1);
  CHECK_THAT(err, Catch::Contains(refused));
  std::ofstream(file) << "run-a token-a\nrun-c token-c\n";
  ::kill(server.proc->pid(), SIGHUP);
  REQUIRE(server.proc->wait_output(
      [&](const std::string& out, const std::string&) {
        return out.find("rdzvd: reloaded " + file + ": 2 runs\n") != std::string::npos;
      },
      30s));
  CHECK(join("run-c", "token-c") == 0);
  CHECK(join("run-c", "token-a") == 1);
  CHECK_THAT(err, Catch::Contains(refused));

  // A file that does not parse: one error line, and the tokens stay as they were.
  std::ofstream(file) << "run-a token-a\nrun-c\n";
  ::kill(server.proc->pid(), SIGHUP);
  const std::string expected = "rdzvd: error: reloading the token file: " + file +
                               " line 2: expected 'RUN_ID TOKEN', got a run id alone; the "
                               "previous tokens stay\n";
  REQUIRE(server.proc->wait_output(
      [&](const std::string&, const std::string& err) { return err.find('\n') != std::string::npos; },
      30s));
  CHECK(server.proc->err() == expected);
  CHECK(join("run-c", "token-c") == 0);
  CHECK(join("run-a", "token-a") == 0);
}

TEST_CASE("security: a bad token file at start: exit 2, one line naming the file and line",
          "[security][tokens]") {
  TempDir dir;
  std::ofstream(dir.file("tokens")) << "run-a token-a\nrun-a token-b\n";
  Proc dup({kRdzvd, "--listen", "127.0.0.1:0", "--token_file", dir.file("tokens")});
  CHECK(dup.wait() == 2);
  CHECK(dup.err() == "rdzvd: error: " + dir.file("tokens") +
                         " line 2: run 'run-a' is already listed on line 1\n");
  CHECK(dup.out().empty());
  Proc missing({kRdzvd, "--listen", "127.0.0.1:0", "--token_file", dir.file("none")});
  CHECK(missing.wait() == 2);
  CHECK(missing.err() == "rdzvd: error: " + dir.file("none") +
                             ": cannot read it (No such file or directory)\n");
}

namespace {

// The processes under `roots` (themselves included) whose program is launch or rdzvd: what
// muster runs for a job, not the workers.
std::vector<pid_t> muster_processes(const std::vector<pid_t>& roots) {
  std::multimap<pid_t, pid_t> children;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    children.emplace(ppid, std::stoi(name));
  }
  std::vector<pid_t> out, todo(roots);
  while (!todo.empty()) {
    const pid_t p = todo.back();
    todo.pop_back();
    std::error_code ec;
    const auto exe = std::filesystem::read_symlink("/proc/" + std::to_string(p) + "/exe", ec);
    if (!ec && (exe == kLaunch || exe == kRdzvd)) out.push_back(p);
    auto [lo, hi] = children.equal_range(p);
    for (auto it = lo; it != hi; ++it) todo.push_back(it->second);
  }
  return out;
}

struct Listener {
  bool loopback = false;
  int port = 0;
};

// The listening TCP sockets of `pid` (its descriptors' inodes in /proc/net/tcp and tcp6).
std::vector<Listener> listeners_of(pid_t pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const auto target = std::filesystem::read_symlink(e.path(), ec).string();
    if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<Listener> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, st, queues, timer, retr, uid, timeout, inode;
      f >> sl >> local >> remote >> st >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (st != "0A" || inodes.count(inode) == 0) continue;
      const auto colon = local.find(':');
      const std::string addr = local.substr(0, colon);
      Listener l;
      l.port = std::stoi(local.substr(colon + 1), nullptr, 16);
      // IPv4: 127.x.x.x (the first byte is the last hex pair); IPv6: ::1.
      l.loopback = addr.size() == 8 ? addr.substr(6) == "7F"
                                    : addr == "00000000000000000000000001000000";
      out.push_back(l);
    }
  }
  return out;
}

}  // namespace

// Issue 40: the store's port was a side door past the tokens (open on the rendezvous
// listener's address, no token asked). Now each agent serves it on loopback, to its own user.
TEST_CASE("security: a token-protected job: launch and rdzvd listen off loopback only on the "
          "rendezvous port, another user's torch client gets no key in or out, the workers do",
          "[security][tokens][torch]") {
  if (!torch_importable()) MUSTER_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  if (::geteuid() != 0) MUSTER_SKIP("needs root, to run a client as nobody");
  if (::access("/usr/sbin/runuser", X_OK) != 0) MUSTER_SKIP("needs runuser");
  TempDir dir;
  std::ofstream(dir.file("tokens")) << "job s3cret\n";
  Proc server({kRdzvd, "--listen", "0.0.0.0:0", "--token_file", dir.file("tokens")});
  REQUIRE(server.wait_output(out_has("listening on port"), 30s));
  std::smatch m;
  const std::string said = server.out();
  REQUIRE(std::regex_search(said, m, std::regex(R"(listening on port (\d+))")));
  const int rdzv_port = std::stoi(m[1].str());
  const std::string ep = "127.0.0.1:" + m[1].str();
  const std::string fifo = dir.file("release");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string script = std::string(INTEROP_SCRIPTS_DIR) + "/store_guarded.py";
  const std::map<std::string, std::optional<std::string>> env{{"PYTHONPATH", std::nullopt}};
  Proc a(agent(ep, "2", 1, "job", "token=s3cret", {"/usr/bin/python3", script, fifo}), env);
  Proc b(agent(ep, "2", 1, "job", "token=s3cret", {"/usr/bin/python3", script, fifo}), env);
  for (Proc* p : {&a, &b}) {
    INFO(p->out() << p->err());
    REQUIRE(p->wait_output(out_has("store ok"), 120s));
  }
  std::set<int> loopback_ports;
  for (pid_t p : muster_processes({server.pid(), a.pid(), b.pid()})) {
    for (const Listener& l : listeners_of(p)) {
      INFO("pid " << p << " listens on port " << l.port);
      CHECK((l.loopback || l.port == rdzv_port));
      if (l.loopback) loopback_ports.insert(l.port);
    }
  }
  // The workers' MASTER_PORT is one of the agents' loopback listeners.
  const std::string a_out = a.out();
  REQUIRE(std::regex_search(a_out, m, std::regex(R"(store ok port (\d+))")));
  const int master_port = std::stoi(m[1].str());
  CHECK(loopback_ports.count(master_port) == 1);
  std::vector<std::string> intruder{"/usr/sbin/runuser", "-u", "nobody", "--", "/usr/bin/python3",
                                    std::string(INTEROP_SCRIPTS_DIR) + "/store_intruder.py",
                                    std::to_string(rdzv_port)};
  for (int port : loopback_ports) intruder.push_back(std::to_string(port));
  Proc nobody(intruder);
  REQUIRE(nobody.wait(120s) == 0);
  INFO(nobody.out() << nobody.err());
  CHECK(nobody.out().find("got in") == std::string::npos);
  CHECK(count_lines_with(nobody.out(), "refused") == static_cast<int>(loopback_ports.size()) + 1);
  // Nor did its SET reach the run's table (the agent's own user looks; torch's client puts
  // "/" before every key).
  TcpStoreClient look(master_port, muster::rendezvous::tcpstore::Dialect::kTorch1);
  CHECK(look.check({"/intruder"}) == false);
  CHECK(look.check({"/mine/0"}) == true);
  {
    std::ofstream release(fifo);
    release << "go\n";
  }
  CHECK(a.wait(60s) == 0);
  CHECK(b.wait(60s) == 0);
  ::kill(server.pid(), SIGTERM);
  CHECK(server.wait(30s) == 0);
}
