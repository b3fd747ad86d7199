// The metrics registry (ops/metrics.h): Prometheus' text exposition format, exactly.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "muster/ops/metrics.h"

using muster::ops::Registry;

TEST_CASE("metrics: counters and gauges render with HELP, TYPE and sorted label sets",
          "[metrics]") {
  Registry r;
  auto& restarts = r.counter("muster_restarts_total", "Restarts by cause", {"cause"});
  restarts.with({"worker_failure"}).inc();
  restarts.with({"worker_failure"}).inc(2);
  restarts.with({"node_lost"}).inc();
  restarts.with({"node_lost"}).inc(-5);  // ignored: counters only go up
  r.gauge("muster_nodes_waiting", "Nodes waiting").get().set(3);
  auto& g = r.gauge("muster_x", "x").get();
  g.inc(2.5);
  g.dec(1);
  CHECK(r.render() ==
        "# HELP muster_restarts_total Restarts by cause\n"
        "# TYPE muster_restarts_total counter\n"
        "muster_restarts_total{cause=\"node_lost\"} 1\n"
        "muster_restarts_total{cause=\"worker_failure\"} 3\n"
        "# HELP muster_nodes_waiting Nodes waiting\n"
        "# TYPE muster_nodes_waiting gauge\n"
        "muster_nodes_waiting 3\n"
        "# HELP muster_x x\n"
        "# TYPE muster_x gauge\n"
        "muster_x 1.5\n");
}

TEST_CASE("metrics: a family with labels but no series yet renders only its HELP and TYPE",
          "[metrics]") {
  Registry r;
  r.counter("a_total", "help", {"op"});
  CHECK(r.render() == "# HELP a_total help\n# TYPE a_total counter\n");
}

TEST_CASE("metrics: label values and HELP are escaped, several labels keep their order",
          "[metrics]") {
  Registry r;
  r.counter("e_total", "a \\ back\nslash", {"b", "a"}).with({"q\"uote", "back\\slash\nnl"}).inc();
  CHECK(r.render() ==
        "# HELP e_total a \\\\ back\\nslash\n"
        "# TYPE e_total counter\n"
        "e_total{b=\"q\\\"uote\",a=\"back\\\\slash\\nnl\"} 1\n");
  // Missing values are empty; extra ones are ignored.
  Registry r2;
  auto& f = r2.counter("m_total", "h", {"x", "y"});
  f.with({"1"}).inc();
  f.with({"1", "", "zzz"}).inc();
  CHECK(r2.render().find("m_total{x=\"1\",y=\"\"} 2\n") != std::string::npos);
}

TEST_CASE("metrics: histograms have cumulative buckets up to +Inf, _sum and _count",
          "[metrics]") {
  Registry r;
  auto& h = r.histogram("muster_recovery_seconds", "Recovery", {"phase"}, {0.5, 1, 2.5});
  auto& total = h.with({"total"});
  total.observe(0.5);  // le="0.5" includes 0.5 itself
  total.observe(0.7);
  total.observe(2);
  total.observe(100);
  total.observe(std::nan(""));  // not counted
  CHECK(r.render() ==
        "# HELP muster_recovery_seconds Recovery\n"
        "# TYPE muster_recovery_seconds histogram\n"
        "muster_recovery_seconds_bucket{phase=\"total\",le=\"0.5\"} 1\n"
        "muster_recovery_seconds_bucket{phase=\"total\",le=\"1\"} 2\n"
        "muster_recovery_seconds_bucket{phase=\"total\",le=\"2.5\"} 3\n"
        "muster_recovery_seconds_bucket{phase=\"total\",le=\"+Inf\"} 4\n"
        "muster_recovery_seconds_sum{phase=\"total\"} 103.2\n"
        "muster_recovery_seconds_count{phase=\"total\"} 4\n");
  Registry r2;
  r2.histogram("h", "h", {}, {1}).get().observe(1);
  CHECK(r2.render() ==
        "# HELP h h\n# TYPE h histogram\n"
        "h_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n");
}

TEST_CASE("metrics: values in Prometheus' spelling", "[metrics]") {
  CHECK(muster::ops::format_value(0) == "0");
  CHECK(muster::ops::format_value(42) == "42");
  CHECK(muster::ops::format_value(0.1) == "0.1");
  CHECK(muster::ops::format_value(1e21) == "1e+21");
  CHECK(muster::ops::format_value(std::numeric_limits<double>::infinity()) == "+Inf");
  CHECK(muster::ops::format_value(-std::numeric_limits<double>::infinity()) == "-Inf");
  CHECK(muster::ops::format_value(std::nan("")) == "NaN");
}

TEST_CASE("metrics: label sets beyond the limit go to one overflow series", "[metrics]") {
  Registry r;
  auto& f = r.counter("c_total", "h", {"k"});
  for (std::size_t i = 0; i < muster::ops::kMaxSeriesPerFamily; ++i) {
    f.with({std::to_string(i)}).inc();
  }
  auto& over = f.with({"one-too-many"});
  over.inc();
  CHECK(&f.with({"another"}) == &over);
  f.with({"another"}).inc();
  CHECK(&f.with({"0"}) != &over);  // existing sets still have their own
  const std::string text = r.render();
  CHECK(text.find("c_total{k=\"_overflow\"} 2\n") != std::string::npos);
  CHECK(text.find("one-too-many") == std::string::npos);
  // One line per series: the limit, plus the overflow one, plus HELP and TYPE.
  CHECK(std::count(text.begin(), text.end(), '\n') ==
        static_cast<long>(muster::ops::kMaxSeriesPerFamily) + 3);
}

TEST_CASE("metrics: long label values are cut at a character boundary", "[metrics]") {
  Registry r;
  // 127 ASCII bytes then a 2-byte character: cut before it, not inside.
  const std::string v = std::string(muster::ops::kMaxLabelValueBytes - 1, 'a') + "\xc3\xa9" + "zz";
  r.gauge("g", "h", {"k"}).with({v}).set(1);
  CHECK(r.render().find("g{k=\"" + std::string(muster::ops::kMaxLabelValueBytes - 1, 'a') +
                        "\"} 1\n") != std::string::npos);
}

TEST_CASE("metrics: the same family twice is one family, a clash is refused", "[metrics]") {
  Registry r;
  auto& a = r.counter("x_total", "h", {"k"});
  CHECK(&r.counter("x_total", "h", {"k"}) == &a);
  // (Registering one of these aborts: a programming error. check() says why, first.)
  using Kind = Registry::Kind;
  CHECK(r.check("x_total", Kind::kCounter, {"k"}).ok());
  CHECK_THAT(std::string(r.check("x_total", Kind::kGauge, {"k"}).message()),
             Catch::Contains("already registered differently"));
  CHECK_FALSE(r.check("x_total", Kind::kCounter, {"other"}).ok());
  CHECK_THAT(std::string(r.check("9bad", Kind::kCounter, {}).message()),
             Catch::Contains("bad metric name '9bad'"));
  CHECK_FALSE(r.check("ok_total", Kind::kCounter, {"bad-label"}).ok());
  CHECK_FALSE(r.check("ok_total", Kind::kCounter, {"__reserved"}).ok());
  CHECK_FALSE(r.check("hh", Kind::kHistogram, {"le"}, {1}).ok());
  CHECK(r.check("hh", Kind::kGauge, {"le"}).ok());  // "le" is only a histogram's
  CHECK_THAT(std::string(r.check("hh", Kind::kHistogram, {}, {2, 1}).message()),
             Catch::Contains("finite and ascending"));
  CHECK(r.check("hh", Kind::kHistogram, {}, {1, 2}).ok());
}

TEST_CASE("metrics: collectors run before each render until removed", "[metrics]") {
  Registry r;
  auto& g = r.gauge("g", "h").get();
  int runs = 0;
  const int id = r.add_collector([&] { g.set(++runs * 10); });
  CHECK(r.render().find("g 10\n") != std::string::npos);
  CHECK(r.render().find("g 20\n") != std::string::npos);
  r.remove_collector(id);
  CHECK(r.render().find("g 20\n") != std::string::npos);
  CHECK(runs == 2);
  r.remove_collector(id);  // twice is fine

  // mirror(): a counter taking a total kept elsewhere, never going down.
  auto& c = r.counter("m_total", "h").get();
  c.mirror(5);
  c.mirror(3);
  CHECK(c.value() == 5);
}

TEST_CASE("metrics: concurrent increments are all counted", "[metrics]") {
  Registry r;
  auto& f = r.counter("n_total", "h", {"t"});
  auto& h = r.histogram("d", "h", {}, {1}).get();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto& c = f.with({t % 2 == 0 ? "even" : "odd"});
      for (int i = 0; i < 10000; ++i) {
        c.inc();
        h.observe(0.5);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(f.with({"even"}).value() == 20000);
  CHECK(f.with({"odd"}).value() == 20000);
  CHECK(h.count() == 40000);
  CHECK(h.cumulative_count(0) == 40000);
  CHECK(h.sum() == 20000);
}

TEST_CASE("metrics: process metrics report this process's resident memory", "[metrics]") {
  Registry r;
  muster::ops::add_process_metrics(r);
  const std::string text = r.render();
  const std::string key = "\nmuster_process_resident_memory_bytes ";
  const auto at = text.find(key);
  REQUIRE(at != std::string::npos);
  const double rss = std::stod(text.substr(at + key.size()));
  CHECK(rss > 1 << 20);        // a test binary holds more than 1 MiB
  CHECK(rss < 64.0 * (1 << 30));
}

// --- the series fed by events (fake times, no sockets) ---------------------------------------

#include "../../rendezvous/src/server/server_metrics.h"
#include "muster/agent/agent_metrics.h"

namespace {

// The value of one sample line ("name{labels} value"), or -1 when it is not there.
double sample(const std::string& text, const std::string& series) {
  const std::string key = "\n" + series + " ";
  const auto at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size()));
}

}  // namespace

TEST_CASE("metrics: the server's counters follow the state machine's events", "[metrics]") {
  using muster::rendezvous::RunEvent;
  Registry r;
  muster::rendezvous::ServerMetrics m;
  auto ev = [](RunEvent::Kind k, std::string cause = "", int round = 1,
               std::chrono::milliseconds took = {}) {
    RunEvent e;
    e.kind = k;
    e.cause = std::move(cause);
    e.round = round;
    e.took = took;
    return e;
  };
  // Before attach (the server not up yet): nothing is registered, events are dropped.
  m.on_event(ev(RunEvent::Kind::kRoundFormed));
  CHECK(r.render().empty());
  m.attach(r);
  std::string text = r.render();
  CHECK(sample(text, "muster_rounds_formed_total") == 0);
  // Known causes are there at zero before anything happened.
  CHECK(sample(text, "muster_restarts_total{cause=\"worker_failure\"}") == 0);
  CHECK(sample(text, "muster_runs{phase=\"running\"}") == 0);
  CHECK(sample(text, "muster_store_operations_total{op=\"multi_get\"}") == 0);

  m.on_event(ev(RunEvent::Kind::kRoundFormed, "", 1));  // a first round: no recovery
  m.on_event(ev(RunEvent::Kind::kWorkerFailed));
  m.on_event(ev(RunEvent::Kind::kRestart, "worker_failure", 1));
  m.on_event(ev(RunEvent::Kind::kRoundFormed, "", 2, std::chrono::milliseconds(300)));
  m.on_event(ev(RunEvent::Kind::kNodeLost, "silent", 2));
  m.on_event(ev(RunEvent::Kind::kRestart, "node_lost", 2));
  m.on_event(ev(RunEvent::Kind::kRoundFormed, "", 3, std::chrono::milliseconds(4000)));
  m.on_event(ev(RunEvent::Kind::kFailed, "budget_spent", 3));
  m.on_event(ev(RunEvent::Kind::kSucceeded));
  text = r.render();
  CHECK(sample(text, "muster_rounds_formed_total") == 3);
  CHECK(sample(text, "muster_worker_failures_total") == 1);
  CHECK(sample(text, "muster_restarts_total{cause=\"worker_failure\"}") == 1);
  CHECK(sample(text, "muster_restarts_total{cause=\"node_lost\"}") == 1);
  CHECK(sample(text, "muster_restarts_total{cause=\"node_joined\"}") == 0);
  CHECK(sample(text, "muster_node_losses_total{cause=\"silent\"}") == 1);
  CHECK(sample(text, "muster_node_losses_total{cause=\"stream_closed\"}") == 0);
  CHECK(sample(text, "muster_runs_finished_total{result=\"budget_spent\"}") == 1);
  CHECK(sample(text, "muster_runs_finished_total{result=\"succeeded\"}") == 1);
  // Two recoveries: 0.3 s and 4 s.
  CHECK(sample(text, "muster_round_recovery_seconds_count") == 2);
  CHECK(sample(text, "muster_round_recovery_seconds_sum") == Approx(4.3));
  CHECK(sample(text, "muster_round_recovery_seconds_bucket{le=\"0.25\"}") == 0);
  CHECK(sample(text, "muster_round_recovery_seconds_bucket{le=\"0.5\"}") == 1);
  CHECK(sample(text, "muster_round_recovery_seconds_bucket{le=\"5\"}") == 2);
}

TEST_CASE("metrics: the agent's series follow its events, with a recovery's phases",
          "[metrics]") {
  using muster::agent::AgentEvent;
  Registry r;
  auto sink = muster::agent::agent_metrics_sink(r);
  const auto t0 = std::chrono::steady_clock::time_point(std::chrono::seconds(1000));
  auto ev = [&](AgentEvent::Kind k) {
    AgentEvent e;
    e.kind = k;
    e.at = t0;
    return e;
  };
  AgentEvent formed = ev(AgentEvent::Kind::kRoundFormed);
  formed.round = 1;
  formed.world_size = 4;
  sink(formed);
  AgentEvent started = ev(AgentEvent::Kind::kWorkersStarted);
  started.workers = 2;
  sink(started);
  CHECK(sample(r.render(), "muster_agent_workers_running") == 2);
  sink(ev(AgentEvent::Kind::kWorkerFailed));
  CHECK(sample(r.render(), "muster_agent_workers_running") == 1);
  sink(ev(AgentEvent::Kind::kRestart));
  sink(ev(AgentEvent::Kind::kWorkersStopped));
  CHECK(sample(r.render(), "muster_agent_workers_running") == 0);
  formed.round = 2;
  formed.restart_count = 1;
  sink(formed);
  muster::agent::Recovery rec;
  rec.cause = "worker_failure";
  rec.noticed = t0;
  rec.stopped = t0 + std::chrono::milliseconds(200);
  rec.formed = t0 + std::chrono::milliseconds(700);
  rec.started = t0 + std::chrono::milliseconds(750);
  started.recovery = rec;
  sink(started);
  sink(ev(AgentEvent::Kind::kSucceeded));
  const std::string text = r.render();
  CHECK(sample(text, "muster_agent_rounds_total") == 2);
  CHECK(sample(text, "muster_agent_restarts_total") == 1);
  CHECK(sample(text, "muster_agent_worker_failures_total") == 1);
  CHECK(sample(text, "muster_agent_round") == 2);
  CHECK(sample(text, "muster_agent_restart_count") == 1);
  CHECK(sample(text, "muster_agent_world_size") == 4);
  CHECK(sample(text, "muster_agent_workers_running") == 0);
  CHECK(sample(text, "muster_agent_recoveries_total{cause=\"worker_failure\"}") == 1);
  CHECK(sample(text, "muster_agent_recoveries_total{cause=\"lost_server\"}") == 0);
  CHECK(sample(text, "muster_agent_runs_finished_total{result=\"succeeded\"}") == 1);
  CHECK(sample(text, "muster_agent_recovery_seconds_sum{phase=\"stop\"}") == Approx(0.2));
  CHECK(sample(text, "muster_agent_recovery_seconds_sum{phase=\"rendezvous\"}") == Approx(0.5));
  CHECK(sample(text, "muster_agent_recovery_seconds_sum{phase=\"start\"}") == Approx(0.05));
  CHECK(sample(text, "muster_agent_recovery_seconds_sum{phase=\"total\"}") == Approx(0.75));
  CHECK(sample(text, "muster_agent_recovery_seconds_bucket{phase=\"total\",le=\"0.5\"}") == 0);
  CHECK(sample(text, "muster_agent_recovery_seconds_bucket{phase=\"total\",le=\"1\"}") == 1);
}
