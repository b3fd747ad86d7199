#include "rdzvd_flags.h"

#include <chrono>

#include "muster/rendezvous/limits.h"

namespace muster::rdzvd {
namespace {

namespace limits = rendezvous::limits;

double secs(std::chrono::milliseconds d) { return std::chrono::duration<double>(d).count(); }

CLI::Range seconds_up_to(std::chrono::milliseconds cap) { return CLI::Range(0.0, secs(cap)); }

std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

}  // namespace

void add_flags(CLI::App& app, Flags& f) {
  f.reattach = secs(limits::kDefaultReattachTimeout);
  f.lease_ttl = secs(limits::kDefaultEtcdLeaseTtl);
  f.etcd_prefix = rendezvous::EtcdOptions{}.prefix;
  app.add_option("--listen", f.listen, "HOST:PORT to listen on (port 0: any free port)");
  app.add_option("--token", f.token, "Shared secret every join must carry (or $MUSTER_RDZV_TOKEN)")
      ->envname("MUSTER_RDZV_TOKEN");
  app.add_option("--token_file,--token-file", f.token_file,
                 "Per-run tokens, 'RUN_ID TOKEN' lines; reloaded on SIGHUP (docs/operations.md)");
  app.add_option("--tls_cert,--tls-cert", f.tls_files.cert, "PEM certificate chain: serve TLS only");
  app.add_option("--tls_key,--tls-key", f.tls_files.key, "PEM private key of --tls_cert");
  app.add_option("--tls_ca,--tls-ca", f.tls_files.client_ca,
                 "PEM CA of the clients' certificates: mutual TLS, every client must show one");
  app.add_option("--join_timeout,--join-timeout", f.join_timeout, "Seconds")
      ->check(CLI::PositiveNumber & seconds_up_to(limits::kMaxJoinTimeout));
  app.add_option("--last_call_timeout,--last-call-timeout", f.last_call, "Seconds")
      ->check(seconds_up_to(limits::kMaxLastCallTimeout));
  app.add_option("--finished_run_grace,--finished-run-grace", f.grace,
                 "Seconds a finished run's id is kept (a late join then gets a clear error)")
      ->check(seconds_up_to(limits::kMaxFinishedRunGrace));
  app.add_option("--hang_timeout,--hang-timeout", f.hang,
                 "Seconds: the default --hang_timeout of runs whose agents set none (0: off; "
                 "docs/hangs.md)")
      ->check(seconds_up_to(limits::kMaxHangTimeout));
  app.add_option("--metrics_port,--metrics-port", f.metrics_port,
                 "Serve Prometheus metrics on 0.0.0.0:PORT/metrics (0: any free port; "
                 "docs/operations.md)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--state_dir,--state-dir", f.state_dir,
                 "Keep every run's state in this (existing, writable) folder and restore it at "
                 "start: rdzvd can then be killed and restarted without restarting any worker");
  app.add_flag("--state_fsync,--state-fsync", f.state_fsync,
               "Flush each write of --state_dir to the disk (survives a power loss; costs a disk "
               "flush per decision)");
  app.add_option("--reattach_timeout,--reattach-timeout", f.reattach,
                 "Seconds a restarted rdzvd holds a running run's places for its nodes to "
                 "re-attach, for runs whose agents set none (rdzv_conf reattach_timeout)")
      ->check(CLI::PositiveNumber & seconds_up_to(limits::kMaxReattachTimeout));
  app.add_option("--etcd", f.etcd_endpoints,
                 "HOST:PORT,...: etcd's client endpoints. Replicated mode: several rdzvd on one "
                 "etcd, one leads, the others stand by and take over (docs/rendezvous.md)");
  app.add_option("--etcd_prefix,--etcd-prefix", f.etcd_prefix,
                 "Key prefix of this group of replicas in etcd");
  app.add_option("--etcd_lease_ttl,--etcd-lease-ttl", f.lease_ttl,
                 "Seconds: the lease of a replica's leadership (a dead leader is replaced after "
                 "about this long; etcd may raise it to its floor)")
      ->check(CLI::Range(1.0, secs(limits::kMaxEtcdLeaseTtl)));
  app.add_option("--advertise", f.advertise,
                 "HOST:PORT other replicas and agents know this one by (default: this host's "
                 "name and the port it listens on)");
  app.add_option("--event_log,--event-log", f.event_log_path,
                 "FILE: one JSON line per run event, appended (\"-\": stderr; docs/operations.md)");
  app.add_option("--http_port,--http-port", f.http_port,
                 "Serve the live page on 0.0.0.0:PORT (0: any free port; off unless given)")
      ->check(CLI::Range(0, 65535));
}

absl::Status check(const Flags& f) {
  if (!f.etcd_endpoints.empty() && !f.state_dir.empty()) {
    return absl::InvalidArgumentError(
        "--etcd and --state_dir exclude each other (with --etcd the runs are kept in etcd)");
  }
  if (f.etcd_endpoints.empty() && !f.advertise.empty()) {
    return absl::InvalidArgumentError("--advertise needs --etcd");
  }
  return absl::OkStatus();
}

rendezvous::RendezvousTimeouts timeouts_of(const Flags& f) {
  rendezvous::RendezvousTimeouts t;
  t.join_timeout = ms(f.join_timeout);
  t.last_call_timeout = ms(f.last_call);
  t.finished_run_grace = ms(f.grace);
  t.hang_timeout = ms(f.hang);
  t.reattach_timeout = ms(f.reattach);
  return t;
}

rendezvous::EtcdOptions etcd_options_of(const Flags& f) {
  rendezvous::EtcdOptions eo;
  eo.endpoints = f.etcd_endpoints;
  eo.prefix = f.etcd_prefix;
  eo.lease_ttl = ms(f.lease_ttl);
  return eo;
}

}  // namespace muster::rdzvd
