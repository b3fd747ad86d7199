// rdzvd: the rendezvous server as a daemon serving many runs (by rdzv_id) at once.
#include <malloc.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include "absl/synchronization/mutex.h"
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <cstdio>
#include <functional>
#include <optional>
#include <thread>

#include "muster/rendezvous/credentials.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/server.h"
#include "muster/rendezvous/tls.h"

int main(int argc, char** argv) {
  // Debian's abseil checks every absl::Mutex (gRPC's too) for lock-order cycles; a server
  // does not need that on its hot path.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::string listen = "0.0.0.0:29400";
  std::string token, token_file;
  muster::rendezvous::ServerTlsFiles tls_files;
  double join_timeout = 600, last_call = 30, grace = 60, hang = 0;
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
  namespace limits = muster::rendezvous::limits;
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "rdzvd: error: %s\n", e.what());
    return 2;
  }
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
  ::signal(SIGPIPE, SIG_IGN);
  // Large buffers (store values, big requests) straight from the kernel and back to it when
  // freed: glibc's default raises this threshold after the first large free, after which
  // such buffers stay in its arenas and a burst leaves the daemon at its peak size.
  ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(limits::kMallocMmapThreshold));
  muster::rendezvous::route_grpc_logs_to_spdlog();
  boost::asio::io_context io(1);
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
  auto server = muster::rendezvous::RendezvousServer::start(io, opts);
  if (!server.ok()) {
    std::fprintf(stderr, "rdzvd: error: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  // The bound port, for callers that asked for port 0.
  std::printf("rdzvd listening on port %d (store for this machine: %s)\n", (*server)->port(),
              (*server)->local_store_target().empty() ? "-" : (*server)->local_store_target().c_str());
  std::fflush(stdout);
  // A stop by SIGINT or SIGTERM is the normal way to end a daemon. Shutdown runs off the io
  // thread while the loop keeps serving the calls it ends; the loop stops once it is done.
  // Further signals while it stops are swallowed (it is stopping already), also after the
  // signal set is gone: a second SIGTERM must not turn a clean stop into death by signal.
  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  std::thread stopper;
  std::function<void()> wait_signal = [&] {
    signals.async_wait([&](const boost::system::error_code& ec, int) {
      if (ec) return;
      if (!stopper.joinable()) {
        stopper = std::thread([&] {
          (*server)->shutdown();
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
  (*server)->shutdown();
  boost::system::error_code ignored;
  if (hup) hup->clear(ignored);
  signals.clear(ignored);  // puts the default actions back, so ignore them right after
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGTERM, SIG_IGN);
  if (hup) ::signal(SIGHUP, SIG_IGN);
  return 0;
}
