// rdzvd: the rendezvous server as a daemon serving many runs (by rdzv_id) at once.
#include <malloc.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <cstdio>
#include <functional>
#include <optional>
#include <thread>

#include "live_page.h"
#include "muster/ops/build_info.h"
#include "muster/ops/http_server.h"
#include "muster/ops/json_lines.h"
#include "muster/ops/metrics.h"
#include "muster/ops/status_format.h"
#include "muster/rendezvous/credentials.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/server.h"
#include "muster/rendezvous/tls.h"
#include "rdzvd_replica.h"
#include "rdzvd_status.h"

int main(int argc, char** argv) {
  // Debian's abseil checks every absl::Mutex (gRPC's too) for lock-order cycles; a server
  // does not need that on its hot path.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::string listen = "0.0.0.0:29400";
  std::string token, token_file;
  muster::rendezvous::ServerTlsFiles tls_files;
  double join_timeout = 600, last_call = 30, grace = 60, hang = 0;
  int metrics_port = -1;  // off
  std::string state_dir;
  bool state_fsync = false;
  namespace limits = muster::rendezvous::limits;
  double reattach = std::chrono::duration<double>(limits::kDefaultReattachTimeout).count();
  CLI::App app{"rdzvd: muster's rendezvous server for many runs", "rdzvd"};
  app.add_option("--listen", listen, "HOST:PORT to listen on (port 0: any free port)");
  app.add_option("--token", token, "Shared secret every join must carry (or $MUSTER_RDZV_TOKEN)")
      ->envname("MUSTER_RDZV_TOKEN");
  app.add_option("--token_file,--token-file", token_file,
                 "Per-run tokens, 'RUN_ID TOKEN' lines; reloaded on SIGHUP (docs/operations.md)");
  app.add_option("--tls_cert,--tls-cert", tls_files.cert, "PEM certificate chain: serve TLS only");
  app.add_option("--tls_key,--tls-key", tls_files.key, "PEM private key of --tls_cert");
  app.add_option("--tls_ca,--tls-ca", tls_files.client_ca,
                 "PEM CA of the clients' certificates: mutual TLS, every client must show one");
  auto seconds_up_to = [](std::chrono::milliseconds cap) {
    return CLI::Range(0.0, std::chrono::duration<double>(cap).count());
  };
  app.add_option("--join_timeout,--join-timeout", join_timeout, "Seconds")
      ->check(CLI::PositiveNumber & seconds_up_to(limits::kMaxJoinTimeout));
  app.add_option("--last_call_timeout,--last-call-timeout", last_call, "Seconds")
      ->check(seconds_up_to(limits::kMaxLastCallTimeout));
  app.add_option("--finished_run_grace,--finished-run-grace", grace,
                 "Seconds a finished run's id is kept (a late join then gets a clear error)")
      ->check(seconds_up_to(limits::kMaxFinishedRunGrace));
  app.add_option("--hang_timeout,--hang-timeout", hang,
                 "Seconds: the default --hang_timeout of runs whose agents set none (0: off; "
                 "docs/hangs.md)")
      ->check(seconds_up_to(limits::kMaxHangTimeout));
  app.add_option("--metrics_port,--metrics-port", metrics_port,
                 "Serve Prometheus metrics on 0.0.0.0:PORT/metrics (0: any free port; "
                 "docs/operations.md)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--state_dir,--state-dir", state_dir,
                 "Keep every run's state in this (existing, writable) folder and restore it at "
                 "start: rdzvd can then be killed and restarted without restarting any worker");
  app.add_flag("--state_fsync,--state-fsync", state_fsync,
               "Flush each write of --state_dir to the disk (survives a power loss; costs a disk "
               "flush per decision)");
  app.add_option("--reattach_timeout,--reattach-timeout", reattach,
                 "Seconds a restarted rdzvd holds a running run's places for its nodes to "
                 "re-attach, for runs whose agents set none (rdzv_conf reattach_timeout)")
      ->check(CLI::PositiveNumber & seconds_up_to(limits::kMaxReattachTimeout));
  std::string etcd_endpoints, etcd_prefix = muster::rendezvous::EtcdOptions{}.prefix, advertise;
  double lease_ttl = std::chrono::duration<double>(limits::kDefaultEtcdLeaseTtl).count();
  app.add_option("--etcd", etcd_endpoints,
                 "HOST:PORT,...: etcd's client endpoints. Replicated mode: several rdzvd on one "
                 "etcd, one leads, the others stand by and take over (docs/rendezvous.md)");
  app.add_option("--etcd_prefix,--etcd-prefix", etcd_prefix,
                 "Key prefix of this group of replicas in etcd");
  app.add_option("--etcd_lease_ttl,--etcd-lease-ttl", lease_ttl,
                 "Seconds: the lease of a replica's leadership (a dead leader is replaced after "
                 "about this long; etcd may raise it to its floor)")
      ->check(CLI::Range(1.0, std::chrono::duration<double>(limits::kMaxEtcdLeaseTtl).count()));
  app.add_option("--advertise", advertise,
                 "HOST:PORT other replicas and agents know this one by (default: this host's "
                 "name and the port it listens on)");
  std::string event_log_path;
  int http_port = -1;
  app.add_option("--event_log,--event-log", event_log_path,
                 "FILE: one JSON line per run event, appended (\"-\": stderr; docs/operations.md)");
  app.add_option("--http_port,--http-port", http_port,
                 "Serve the live page on 0.0.0.0:PORT (0: any free port; off unless given)")
      ->check(CLI::Range(0, 65535));
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
    std::fprintf(stderr, "rdzvd: error: %s\n", e.what());
    return 2;
  }
  if (status_command.parsed()) return status_command.run();
  auto usage = [](const absl::Status& s) {
    std::fprintf(stderr, "rdzvd: error: %s\n", std::string(s.message()).c_str());
    return 2;
  };
  auto tls = muster::rendezvous::load_server_tls(tls_files);
  if (!tls.ok()) return usage(tls.status());
  std::optional<muster::rendezvous::RunTokens> run_tokens;
  if (!token_file.empty()) {
    auto loaded = muster::rendezvous::load_token_file(token_file);
    if (!loaded.ok()) return usage(loaded.status());
    run_tokens = std::move(*loaded);
  }
  if (!etcd_endpoints.empty() && !state_dir.empty()) {
    std::fprintf(stderr, "rdzvd: error: --etcd and --state_dir exclude each other (with --etcd the "
                         "runs are kept in etcd)\n");
    return 2;
  }
  if (etcd_endpoints.empty() && (!advertise.empty())) {
    std::fprintf(stderr, "rdzvd: error: --advertise needs --etcd\n");
    return 2;
  }
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
  muster::rendezvous::ServerOptions opts;
  opts.listen_address = listen;
  opts.token = token;
  opts.run_tokens = std::move(run_tokens);
  opts.tls = std::move(*tls);
  opts.timeouts.join_timeout =
      std::chrono::milliseconds(static_cast<long long>(join_timeout * 1000));
  opts.timeouts.last_call_timeout =
      std::chrono::milliseconds(static_cast<long long>(last_call * 1000));
  opts.timeouts.finished_run_grace =
      std::chrono::milliseconds(static_cast<long long>(grace * 1000));
  opts.timeouts.hang_timeout = std::chrono::milliseconds(static_cast<long long>(hang * 1000));
  // Made before the server (which adds its series) and outliving it.
  muster::ops::Registry metrics;
  std::unique_ptr<muster::ops::HttpServer> metrics_http;
  if (metrics_port >= 0) {
    muster::ops::add_process_metrics(metrics);
    opts.metrics = &metrics;
    auto http = muster::ops::HttpServer::start("0.0.0.0", metrics_port,
                                               muster::ops::metrics_routes(metrics));
    if (!http.ok()) {
      std::fprintf(stderr, "rdzvd: error: --metrics_port: %s\n",
                   std::string(http.status().message()).c_str());
      return 1;
    }
    metrics_http = std::move(*http);
  }
  opts.timeouts.reattach_timeout =
      std::chrono::milliseconds(static_cast<long long>(reattach * 1000));
  if (!state_dir.empty()) {
    auto store = muster::rendezvous::open_file_run_store({state_dir, state_fsync});
    if (!store.ok()) {
      std::fprintf(stderr, "rdzvd: error: --state_dir: %s\n",
                   std::string(store.status().message()).c_str());
      return 2;
    }
    opts.run_store = std::move(*store);
  }
  std::unique_ptr<muster::ops::JsonLinesFile> event_log;
  if (!event_log_path.empty()) {
    auto opened = muster::ops::JsonLinesFile::open(event_log_path, "--event_log");
    if (!opened.ok()) {
      std::fprintf(stderr, "rdzvd: error: %s\n", std::string(opened.status().message()).c_str());
      return 2;
    }
    event_log = std::move(*opened);
    opts.event_sinks.push_back([log = event_log.get()](const muster::rendezvous::RunEvent& e) {
      log->write_line(muster::ops::event_json(e, muster::ops::wall_time_of(e)));
    });
  }
  // Replicated mode: a lease first (etcd must answer), then the server as a standby; it
  // leads once its campaign is won (rdzvd_replica.h).
  std::unique_ptr<muster::rdzvd::ReplicaRole> replica;
  if (!etcd_endpoints.empty()) {
    muster::rendezvous::EtcdOptions eo;
    eo.endpoints = etcd_endpoints;
    eo.prefix = etcd_prefix;
    eo.lease_ttl = std::chrono::milliseconds(static_cast<long long>(lease_ttl * 1000));
    auto connected = muster::rdzvd::ReplicaRole::connect(eo, opts);
    if (!connected.ok()) {
      if (absl::IsInvalidArgument(connected.status())) return usage(connected.status());
      std::fprintf(stderr, "rdzvd: error: %s\n", std::string(connected.status().message()).c_str());
      return 1;
    }
    replica = std::move(*connected);
  }
  auto feed = std::make_shared<muster::rdzvd::EventFeed>();
  if (http_port >= 0) opts.event_sinks.push_back([feed](const auto& e) { feed->add(e); });
  auto server = muster::rendezvous::RendezvousServer::start(io, opts);
  if (!server.ok()) {
    std::fprintf(stderr, "rdzvd: error: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  // The bound port, for callers that asked for port 0.
  std::printf("rdzvd listening on port %d (store for this machine: %s)\n", (*server)->port(),
              (*server)->local_store_target().empty() ? "-" : (*server)->local_store_target().c_str());
  if (metrics_http) std::printf("rdzvd metrics on port %d\n", metrics_http->port());
  if (replica) replica->start(**server, advertise);
  // The replica's threads (its campaign, its observer of who leads) call the server: they end
  // before the server does, however main returns (an observer that saw the next leader after a
  // SIGTERM would otherwise call a destroyed server).
  absl::Cleanup replica_before_server = [&replica] { replica.reset(); };
  if (!state_dir.empty()) {
    const auto& r = (*server)->restored();
    for (const std::string& line : r.skipped) {
      std::printf("rdzvd: --state_dir: skipped %s\n", line.c_str());
    }
    std::printf("rdzvd: restored %d runs from %s (%d running, their places held for re-attach)\n",
                r.runs, state_dir.c_str(), r.running);
  }
  std::fflush(stdout);
  std::unique_ptr<muster::ops::HttpServer> page;
  if (http_port >= 0) {
    auto started = muster::ops::HttpServer::start(
        "0.0.0.0", http_port,
        muster::rdzvd::live_page_routes(feed, muster::rdzvd::status_source_of(**server)));
    if (!started.ok()) {
      std::fprintf(stderr, "rdzvd: error: %s\n", std::string(started.status().message()).c_str());
      (*server)->shutdown();
      if (replica) replica->resign();
      return 1;
    }
    page = std::move(*started);
    std::printf("rdzvd page on port %d\n", page->port());
    std::fflush(stdout);
  }
  // A stop by SIGINT or SIGTERM is the normal way to end a daemon. Shutdown runs off the io
  // thread while the loop keeps serving the calls it ends; the loop stops once it is done.
  // Further signals while it stops are swallowed (it is stopping already), also after the
  // signal set is gone: a second SIGTERM must not turn a clean stop into death by signal.
  std::thread stopper;
  std::function<void()> wait_signal = [&] {
    signals.async_wait([&](const boost::system::error_code& ec, int) {
      if (ec) return;
      if (!stopper.joinable()) {
        stopper = std::thread([&] {
          if (page) page->stop();  // first: its handlers wait for the io thread
          (*server)->shutdown();
          // Then the leadership: a standby takes over at once, not after the lease.
          if (replica) replica->resign();
          io.stop();
        });
      }
      wait_signal();
    });
  };
  wait_signal();
  // SIGHUP reloads the token file (on the io thread: a small file, read once). A file that
  // does not parse leaves the tables as they were. Without --token_file, SIGHUP keeps its
  // default action.
  std::optional<boost::asio::signal_set> hup;
  std::function<void()> wait_hup = [&] {
    hup->async_wait([&](const boost::system::error_code& ec, int) {
      if (ec) return;
      auto loaded = muster::rendezvous::load_token_file(token_file);
      if (loaded.ok()) {
        const std::size_t n = loaded->size();
        (*server)->set_run_tokens(std::move(*loaded));
        std::printf("rdzvd: reloaded %s: %zu run%s\n", token_file.c_str(), n, n == 1 ? "" : "s");
        std::fflush(stdout);
      } else {
        std::fprintf(stderr, "rdzvd: error: reloading the token file: %s; the previous tokens stay\n",
                     std::string(loaded.status().message()).c_str());
      }
      wait_hup();
    });
  };
  if (!token_file.empty()) {
    hup.emplace(io, SIGHUP);
    wait_hup();
  }
  auto guard = boost::asio::make_work_guard(io);
  io.run();
  if (stopper.joinable()) stopper.join();
  if (metrics_http) metrics_http->stop();  // before the server: scrapes sample it
  (*server)->shutdown();
  boost::system::error_code ignored;
  if (hup) hup->clear(ignored);
  signals.clear(ignored);  // puts the default actions back, so ignore them right after
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGTERM, SIG_IGN);
  if (hup) ::signal(SIGHUP, SIG_IGN);
  return 0;
}
