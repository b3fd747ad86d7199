// /metrics on rdzvd and launch (real processes, loopback, port 0), the gRPC health service
// through a real client, and a real Prometheus scraping both (docs/operations.md).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>
#include <fstream>
#include <memory>
#include <regex>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "health_check.h"
#include "helpers.h"
#include "http_get.h"
#include "rdzvd_proc.h"
#include "muster/rendezvous/grpc_store.h"
#include "muster/rendezvous/server.h"

using namespace muster::testing;
namespace health = grpc::health::v1;

namespace {

std::string scrape(int port) {
  HttpReply r = http_get(port, "/metrics");
  INFO(r.status_line);
  CHECK(r.status_line == "HTTP/1.1 200 OK");
  return r.body;
}

// The value of one sample ("name{labels} value" as rendered), or -1 when it is not there.
double sample(const std::string& text, const std::string& series) {
  const std::string key = "\n" + series + " ";
  const auto at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size()));
}

int port_in(const std::string& text, const std::string& pattern) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(pattern))) return 0;
  return std::stoi(m[1].str());
}


const std::map<std::string, std::optional<std::string>> kInfoLog{{"MUSTER_LOG_LEVEL", "info"}};

// A launch's metrics port, from its log ("metrics on port N").
int launch_metrics_port(Proc& p) {
  REQUIRE(p.wait_output(
      [](const std::string&, const std::string& err) {
        return std::regex_search(err, std::regex(R"(metrics on port \d+\n)"));
      },
      30s));
  return port_in(p.err(), R"(metrics on port (\d+))");
}

void stop(Proc& p) {
  ::kill(p.pid(), SIGTERM);
  CHECK(p.wait(30s) == 128 + SIGTERM);
}

// One agent of run "job" with one worker, its metrics on a free port.
std::vector<std::string> agent(const std::string& endpoint, int nnodes,
                               std::vector<std::string> extra = {}) {
  extra.insert(extra.begin(), "--metrics_port=0");
  return c10d(endpoint, std::to_string(nnodes), 1, "job", std::move(extra));
}


}  // namespace

TEST_CASE("metrics: rdzvd's and each launch's /metrics count a worker failure and its restart",
          "[metrics]") {
  RdzvdProc server({"--metrics_port", "0"});
  TempDir dir;
  // Round 1: rank 0 (one of the two nodes) exits 3; round 2 (restart 1): both wait.
  const std::vector<std::string> worker{"restart", dir.path(), "1", "wait"};
  Proc a(launch_args(agent(server.endpoint, 2, {"--max_restarts=1"}), worker), kInfoLog);
  Proc b(launch_args(agent(server.endpoint, 2, {"--max_restarts=1"}), worker), kInfoLog);
  const int a_port = launch_metrics_port(a);
  const int b_port = launch_metrics_port(b);
  REQUIRE(a.wait_output(has_ready(1, "restart 1"), 60s));
  REQUIRE(b.wait_output(has_ready(1, "restart 1"), 60s));

  // A store client of the run: its requests are counted by op.
  muster::rendezvous::GrpcStoreOptions so;
  so.target = server.endpoint;
  so.run_id = "job";
  {
    muster::rendezvous::GrpcStore store(so);
    REQUIRE(store.set("k", "v").ok());
    REQUIRE(store.add("n", 2).ok());
    REQUIRE(store.get("k", 10s).ok());
  }

  const std::string s = scrape(server.metrics_port);
  INFO(s);
  CHECK(sample(s, "muster_rounds_formed_total") == 2);
  CHECK(sample(s, "muster_restarts_total{cause=\"worker_failure\"}") == 1);
  CHECK(sample(s, "muster_restarts_total{cause=\"node_lost\"}") == 0);
  CHECK(sample(s, "muster_worker_failures_total") == 1);
  CHECK(sample(s, "muster_round_recovery_seconds_count") == 1);
  CHECK(sample(s, "muster_round_recovery_seconds_bucket{le=\"+Inf\"}") == 1);
  CHECK(sample(s, "muster_runs{phase=\"running\"}") == 1);
  CHECK(sample(s, "muster_runs{phase=\"joining\"}") == 0);
  CHECK(sample(s, "muster_nodes_members") == 2);
  CHECK(sample(s, "muster_nodes_connected") == 2);
  CHECK(sample(s, "muster_nodes_waiting") == 0);
  CHECK(sample(s, "muster_agent_streams") == 2);
  CHECK(sample(s, "muster_store_operations_total{op=\"set\"}") >= 1);
  CHECK(sample(s, "muster_store_operations_total{op=\"add\"}") >= 1);
  CHECK(sample(s, "muster_store_operations_total{op=\"get\"}") >= 1);
  CHECK(sample(s, "muster_store_waits_parked") == 0);
  CHECK(sample(s, "muster_process_resident_memory_bytes") > 1e6);

  double failures = 0, recoveries_by_failure = 0, recoveries_by_restart = 0;
  for (int port : {a_port, b_port}) {
    const std::string t = scrape(port);
    INFO(t);
    CHECK(sample(t, "muster_agent_rounds_total") == 2);
    CHECK(sample(t, "muster_agent_round") == 2);
    CHECK(sample(t, "muster_agent_restart_count") == 1);
    CHECK(sample(t, "muster_agent_restarts_total") == 1);
    CHECK(sample(t, "muster_agent_workers_running") == 1);
    CHECK(sample(t, "muster_agent_recovery_seconds_count{phase=\"total\"}") == 1);
    CHECK(sample(t, "muster_agent_recovery_seconds_count{phase=\"rendezvous\"}") == 1);
    CHECK(sample(t, "muster_process_resident_memory_bytes") > 1e6);
    // Neither launch hosts the rendezvous: no server series here.
    CHECK(sample(t, "muster_rounds_formed_total") == -1);
    failures += sample(t, "muster_agent_worker_failures_total");
    recoveries_by_failure += sample(t, "muster_agent_recoveries_total{cause=\"worker_failure\"}");
    recoveries_by_restart += sample(t, "muster_agent_recoveries_total{cause=\"restart\"}");
  }
  // The node whose worker failed noticed it first; the other was told by the server.
  CHECK(failures == 1);
  CHECK(recoveries_by_failure == 1);
  CHECK(recoveries_by_restart == 1);
  CHECK(http_get(server.metrics_port, "/nope").status_line.rfind("HTTP/1.1 404", 0) == 0);
  stop(a);
  stop(b);
}

TEST_CASE("metrics: a launch hosting the rendezvous serves the server's series too",
          "[metrics]") {
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--metrics_port=0"}, {"wait"}),
         kInfoLog);
  const int port = launch_metrics_port(p);
  REQUIRE(p.wait_output(has_ready(2), 60s));
  const std::string t = scrape(port);
  INFO(t);
  CHECK(sample(t, "muster_rounds_formed_total") == 1);
  CHECK(sample(t, "muster_runs{phase=\"running\"}") == 1);
  CHECK(sample(t, "muster_nodes_members") == 1);
  CHECK(sample(t, "muster_agent_rounds_total") == 1);
  CHECK(sample(t, "muster_agent_workers_running") == 2);
  CHECK(sample(t, "muster_agent_world_size") == 2);
  // One HELP line per family: the server's and the agent's share one registry.
  CHECK(count_lines_with(t, "# HELP muster_process_resident_memory_bytes ") == 1);
  stop(p);
}

TEST_CASE("version: --version of both binaries, status --json and muster_build_info agree",
          "[metrics][version]") {
  Proc lv({kLaunch, "--version"});
  REQUIRE(lv.wait(30s) == 0);
  std::smatch m;
  const std::string line = lv.out();
  REQUIRE(std::regex_match(line, m, std::regex(R"(launch (\d+\.\d+\.\d+) \(commit (\S+)\)\n)")));
  const std::string version = m[1], commit = m[2];
  CHECK(commit != "unknown");  // built from a git checkout
  Proc rv({kRdzvd, "--version"});
  REQUIRE(rv.wait(30s) == 0);
  CHECK(rv.out() == "rdzvd " + version + " (commit " + commit + ")\n");

  Proc p(launch_args({"--standalone", "--nproc_per_node=1", "--metrics_port=0"}, {"wait"}),
         kInfoLog);
  const int port = launch_metrics_port(p);
  REQUIRE(p.wait_output(has_ready(1), 60s));
  const std::string t = scrape(port);
  INFO(t);
  CHECK(sample(t, "muster_build_info{version=\"" + version + "\",commit=\"" + commit + "\"}") ==
        1);
  stop(p);
}

TEST_CASE("metrics: a taken or bad --metrics_port is an error line and a non-zero exit",
          "[metrics]") {
  RdzvdProc server({"--metrics_port", "0"});
  const std::string taken = std::to_string(server.metrics_port);
  Proc r({kRdzvd, "--listen", "127.0.0.1:0", "--metrics_port", taken});
  CHECK(r.wait(30s) == 1);
  CHECK_THAT(r.err(), Catch::StartsWith("rdzvd: error: --metrics_port: "));
  Proc bad({kRdzvd, "--listen", "127.0.0.1:0", "--metrics_port", "70000"});
  CHECK(bad.wait(30s) == 2);
  CHECK_THAT(bad.err(), Catch::StartsWith("rdzvd: error: "));
  Proc l(launch_args({"--standalone", "--metrics_port=" + taken}, {"wait"}));
  CHECK(l.wait(30s) == 1);
  CHECK_THAT(l.err(), Catch::Contains("launch: error: --metrics_port: "));
  Proc lbad(launch_args({"--standalone", "--metrics_port=-3"}, {"wait"}));
  CHECK(lbad.wait(30s) == 2);
  CHECK_THAT(lbad.err(), Catch::Contains("launch: error: "));
}

TEST_CASE("health: rdzvd answers grpc.health.v1 Check: SERVING for the server and its services",
          "[health]") {
  RdzvdProc server({"--metrics_port", "0"});
  auto channel = grpc::CreateChannel(server.endpoint, grpc::InsecureChannelCredentials());
  auto stub = health::Health::NewStub(channel);
  CHECK(check(*stub, "") == health::HealthCheckResponse::SERVING);
  CHECK(check(*stub, "muster.v1.Rendezvous") == health::HealthCheckResponse::SERVING);
  CHECK(check(*stub, "muster.v1.Store") == health::HealthCheckResponse::SERVING);
  grpc::StatusCode code = grpc::StatusCode::OK;
  check(*stub, "no.such.Service", &code);
  CHECK(code == grpc::StatusCode::NOT_FOUND);
}

TEST_CASE("health: a Watch sees NOT_SERVING as soon as the server's shutdown starts",
          "[health]") {
  boost::asio::io_context io;
  muster::rendezvous::ServerOptions opts;
  auto server = muster::rendezvous::RendezvousServer::start(io, opts);
  REQUIRE(server.ok());
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string((*server)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = health::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  health::HealthCheckRequest req;
  auto watch = stub->Watch(&ctx, req);
  health::HealthCheckResponse resp;
  REQUIRE(watch->Read(&resp));
  CHECK(resp.status() == health::HealthCheckResponse::SERVING);
  // With a grace, the server waits for this call; the Watch hears NOT_SERVING meanwhile.
  std::thread stopper([&] { (*server)->shutdown(std::chrono::seconds(20)); });
  const bool read = watch->Read(&resp);
  CHECK(read);
  CHECK(resp.status() == health::HealthCheckResponse::NOT_SERVING);
  ctx.TryCancel();
  while (watch->Read(&resp)) {
  }
  watch->Finish();
  stopper.join();
}

TEST_CASE("metrics: a real Prometheus scrapes rdzvd and launch and answers a query",
          "[metrics][prometheus]") {
  const std::string prometheus = find_on_path("prometheus");
  if (prometheus.empty()) MUSTER_SKIP("no prometheus on PATH (Debian's prometheus package)");
  RdzvdProc server({"--metrics_port", "0"});
  Proc node(launch_args(agent(server.endpoint, 1), {"wait"}), kInfoLog);
  const int agent_port = launch_metrics_port(node);
  REQUIRE(node.wait_output(has_ready(1), 60s));

  TempDir dir;
  {
    std::ofstream cfg(dir.file("prometheus.yml"));
    cfg << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        << "scrape_configs:\n"
        << "  - job_name: rdzvd\n    static_configs:\n      - targets: ['127.0.0.1:"
        << server.metrics_port << "']\n"
        << "  - job_name: launch\n    static_configs:\n      - targets: ['127.0.0.1:"
        << agent_port << "']\n";
  }
  const int web_port = free_port();
  Proc prom({prometheus, "--config.file=" + dir.file("prometheus.yml"),
             "--storage.tsdb.path=" + dir.file("data"),
             "--web.listen-address=127.0.0.1:" + std::to_string(web_port)});
  REQUIRE(prom.wait_output(
      [](const std::string&, const std::string& err) {
        return err.find("Server is ready to receive web requests") != std::string::npos;
      },
      60s));
  REQUIRE(http_get(web_port, "/-/ready").status_line.find(" 200 ") != std::string::npos);

  // Polls a query until its answer holds `want` (Prometheus scrapes once a second; each
  // round trip here is a real query, so the wait is bounded, not a fixed sleep).
  auto query_until = [&](const std::string& query, const std::string& want) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    std::string last;
    while (std::chrono::steady_clock::now() < deadline) {
      last = http_get(web_port, "/api/v1/query?query=" + query).body;
      if (last.find(want) != std::string::npos) return true;
      std::this_thread::sleep_for(200ms);
    }
    UNSCOPED_INFO("last answer to " << query << ": " << last);
    return false;
  };
  // Instant vectors: [{"metric":{...},"value":[<time>,"<value>"]}]. Each query selects one
  // series (by job) and waits for its value.
  CHECK(query_until("muster_rounds_formed_total%7Bjob%3D%22rdzvd%22%7D", ",\"1\"]"));
  CHECK(query_until("muster_runs%7Bjob%3D%22rdzvd%22%2Cphase%3D%22running%22%7D", ",\"1\"]"));
  CHECK(query_until("muster_agent_workers_running%7Bjob%3D%22launch%22%7D", ",\"1\"]"));
  CHECK(query_until("muster_agent_rounds_total%7Bjob%3D%22launch%22%7D", ",\"1\"]"));
  // Both targets are up (scraped and parsed without an error).
  CHECK(query_until("sum%28up%29", ",\"2\"]"));
  // The launch does not host the rendezvous (rdzvd does): no server series from it.
  CHECK(query_until("count%28muster_rounds_formed_total%29", ",\"1\"]"));

  ::kill(prom.pid(), SIGTERM);
  CHECK(prom.wait(30s) == 0);
  stop(node);
}
