// rdzvd: the rendezvous server as a daemon serving many runs (by rdzv_id) at once.
#include <malloc.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <cstdio>
#include <functional>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "live_page.h"
#include "muster/ops/build_info.h"
#include "muster/ops/exit_codes.h"
#include "muster/ops/http_server.h"
#include "muster/ops/json_lines.h"
#include "muster/ops/metrics.h"
#include "muster/status/status_format.h"
#include "muster/rendezvous/credentials.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/server.h"
#include "muster/rendezvous/tls.h"
#include "rdzvd_flags.h"
#include "rdzvd_replica.h"
#include "rdzvd_status.h"

namespace {

namespace limits = muster::rendezvous::limits;
using muster::ops::ExitError;
using muster::ops::kExitRuntime;
using muster::ops::kExitUsage;

ExitError usage(const absl::Status& s) { return {kExitUsage, s}; }
ExitError runtime(const absl::Status& s) { return {kExitRuntime, s}; }
absl::Status prefixed(const char* flag, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(flag, ": ", s.message()));
}

// Everything the daemon runs with, made from its flags before the server starts.
struct Daemon {
  muster::rdzvd::Flags flags;
  muster::rendezvous::ServerOptions opts;
  // Made before the server (which adds its series) and outliving it.
  muster::ops::Registry metrics;
  std::unique_ptr<muster::ops::HttpServer> metrics_http;
  std::unique_ptr<muster::ops::JsonLinesFile> event_log;
  std::unique_ptr<muster::rdzvd::ReplicaRole> replica;
  std::shared_ptr<muster::rdzvd::EventFeed> feed = std::make_shared<muster::rdzvd::EventFeed>();
};

// The server's options from the flags; the files they name are read here (usage errors).
std::optional<ExitError> configure(Daemon& d) {
  const muster::rdzvd::Flags& f = d.flags;
  if (absl::Status s = muster::rdzvd::check(f); !s.ok()) return usage(s);
  auto tls = muster::rendezvous::load_server_tls(f.tls_files);
  if (!tls.ok()) return usage(tls.status());
  if (!f.token_file.empty()) {
    auto loaded = muster::rendezvous::load_token_file(f.token_file);
    if (!loaded.ok()) return usage(loaded.status());
    d.opts.run_tokens = std::move(*loaded);
  }
  d.opts.listen_address = f.listen;
  d.opts.token = f.token;
  d.opts.tls = std::move(*tls);
  d.opts.timeouts = muster::rdzvd::timeouts_of(f);
  if (!f.state_dir.empty()) {
    auto store = muster::rendezvous::open_file_run_store({f.state_dir, f.state_fsync});
    if (!store.ok()) return usage(prefixed("--state_dir", store.status()));
    d.opts.run_store = std::move(*store);
  }
  if (!f.event_log_path.empty()) {
    auto opened = muster::ops::JsonLinesFile::open(f.event_log_path, "--event_log");
    if (!opened.ok()) return usage(opened.status());
    d.event_log = std::move(*opened);
    d.opts.event_sinks.push_back([log = d.event_log.get()](const muster::rendezvous::RunEvent& e) {
      log->write_line(muster::status::event_json(e, muster::status::wall_time_of(e)));
    });
  }
  if (f.http_port >= 0) d.opts.event_sinks.push_back([feed = d.feed](const auto& e) { feed->add(e); });
  return std::nullopt;
}

// The metrics endpoint and, in replicated mode, the lease (etcd must answer): the server then
// starts as a standby and leads once its campaign is won (rdzvd_replica.h).
std::optional<ExitError> connect(Daemon& d) {
  if (d.flags.metrics_port >= 0) {
    muster::ops::add_process_metrics(d.metrics);
    d.opts.metrics = &d.metrics;
    auto http = muster::ops::HttpServer::start("0.0.0.0", d.flags.metrics_port,
                                               muster::ops::metrics_routes(d.metrics));
    if (!http.ok()) return runtime(prefixed("--metrics_port", http.status()));
    d.metrics_http = std::move(*http);
  }
  if (d.flags.etcd_endpoints.empty()) return std::nullopt;
  auto connected = muster::rdzvd::ReplicaRole::connect(muster::rdzvd::etcd_options_of(d.flags), d.opts);
  if (!connected.ok()) {
    return ExitError{absl::IsInvalidArgument(connected.status()) ? kExitUsage : kExitRuntime,
                     connected.status()};
  }
  d.replica = std::move(*connected);
  return std::nullopt;
}

void announce(const Daemon& d, const muster::rendezvous::RendezvousServer& server) {
  // The bound port, for callers that asked for port 0.
  std::printf("rdzvd listening on port %d (store for this machine: %s)\n", server.port(),
              server.local_store_target().empty() ? "-" : server.local_store_target().c_str());
  if (d.metrics_http) std::printf("rdzvd metrics on port %d\n", d.metrics_http->port());
  if (!d.flags.state_dir.empty()) {
    const auto& r = server.restored();
    for (const std::string& line : r.skipped) {
      std::printf("rdzvd: --state_dir: skipped %s\n", line.c_str());
    }
    std::printf("rdzvd: restored %d runs from %s (%d running, their places held for re-attach)\n",
                r.runs, d.flags.state_dir.c_str(), r.running);
  }
  std::fflush(stdout);
}

// SIGHUP reloads the token file (on the io thread: a small file, read once). A file that does
// not parse leaves the tables as they were.
void reload_tokens(const std::string& path, muster::rendezvous::RendezvousServer& server) {
  auto loaded = muster::rendezvous::load_token_file(path);
  if (!loaded.ok()) {
    std::fprintf(stderr, "rdzvd: error: reloading the token file: %s; the previous tokens stay\n",
                 std::string(loaded.status().message()).c_str());
    return;
  }
  const std::size_t n = loaded->size();
  server.set_run_tokens(std::move(*loaded));
  std::printf("rdzvd: reloaded %s: %zu run%s\n", path.c_str(), n, n == 1 ? "" : "s");
  std::fflush(stdout);
}

// Calls `handler` on the loop for every `sig` that comes, until the set is cleared.
void on_each(boost::asio::signal_set& set, std::function<void()> handler) {
  set.async_wait([&set, handler = std::move(handler)](const boost::system::error_code& ec, int) {
    if (ec) return;
    handler();
    on_each(set, handler);
  });
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's abseil checks every absl::Mutex (gRPC's too) for lock-order cycles; a server
  // does not need that on its hot path.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  Daemon d;
  CLI::App app{"rdzvd: muster's rendezvous server for many runs", "rdzvd"};
  muster::rdzvd::add_flags(app, d.flags);
  app.set_version_flag("--version", muster::ops::version_line("rdzvd"),
                       "Show the version and commit and exit");
  muster::rdzvd::StatusCommand status_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return muster::ops::usage_error("rdzvd", absl::InvalidArgumentError(e.what()));
  }
  if (status_command.parsed()) return status_command.run();
  if (auto e = configure(d)) return muster::ops::report("rdzvd", *e);
  ::signal(SIGPIPE, SIG_IGN);
  // Large buffers (store values, big requests) straight from the kernel and back to it when
  // freed: glibc's default raises this threshold after the first large free, after which
  // such buffers stay in its arenas and a burst leaves the daemon at its peak size.
  ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(limits::kMallocMmapThreshold));
  muster::rendezvous::route_grpc_logs_to_spdlog();
  boost::asio::io_context io(1);
  // SIGINT and SIGTERM are caught from here on: one that comes before the loop runs (right
  // after "listening", say) waits for it and is a clean stop, not death by signal.
  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  if (auto e = connect(d)) return muster::ops::report("rdzvd", *e);
  auto started = muster::rendezvous::RendezvousServer::start(io, d.opts);
  if (!started.ok()) return muster::ops::runtime_error("rdzvd", started.status());
  muster::rendezvous::RendezvousServer& server = **started;
  announce(d, server);
  if (d.replica) d.replica->start(server, d.flags.advertise);
  // The replica's threads (its campaign, its observer of who leads) call the server: they end
  // before the server does, however main returns (an observer that saw the next leader after a
  // SIGTERM would otherwise call a destroyed server).
  absl::Cleanup replica_before_server = [&d] { d.replica.reset(); };
  std::unique_ptr<muster::ops::HttpServer> page;
  if (d.flags.http_port >= 0) {
    auto page_started = muster::ops::HttpServer::start(
        "0.0.0.0", d.flags.http_port,
        muster::rdzvd::live_page_routes(d.feed, muster::rdzvd::status_source_of(server)));
    if (!page_started.ok()) {
      server.shutdown();
      if (d.replica) d.replica->resign();
      return muster::ops::runtime_error("rdzvd", page_started.status());
    }
    page = std::move(*page_started);
    std::printf("rdzvd page on port %d\n", page->port());
    std::fflush(stdout);
  }
  // A stop by SIGINT or SIGTERM is the normal way to end a daemon. Shutdown runs off the io
  // thread while the loop keeps serving the calls it ends; the loop stops once it is done.
  // Further signals while it stops are swallowed (it is stopping already), also after the
  // signal set is gone: a second SIGTERM must not turn a clean stop into death by signal.
  std::thread stopper;
  on_each(signals, [&] {
    if (stopper.joinable()) return;
    stopper = std::thread([&] {
      if (page) page->stop();  // first: its handlers wait for the io thread
      server.shutdown();
      // Then the leadership: a standby takes over at once, not after the lease.
      if (d.replica) d.replica->resign();
      io.stop();
    });
  });
  // Without --token_file, SIGHUP keeps its default action.
  std::optional<boost::asio::signal_set> hup;
  if (!d.flags.token_file.empty()) {
    hup.emplace(io, SIGHUP);
    on_each(*hup, [&] { reload_tokens(d.flags.token_file, server); });
  }
  auto guard = boost::asio::make_work_guard(io);
  io.run();
  if (stopper.joinable()) stopper.join();
  if (d.metrics_http) d.metrics_http->stop();  // before the server: scrapes sample it
  server.shutdown();
  boost::system::error_code ignored;
  if (hup) hup->clear(ignored);
  signals.clear(ignored);  // puts the default actions back, so ignore them right after
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGTERM, SIG_IGN);
  if (hup) ::signal(SIGHUP, SIG_IGN);
  return 0;
}
