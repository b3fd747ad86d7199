// Real ssh between the hosts of a HostNet (hostnet.h): Debian's sshd (/usr/sbin/sshd) in each
// chosen host, for the current user (root, as HostNet needs), with keys made for the test.
//
// Everything lives in `dir` (the caller's, e.g. a TempDir; made if missing), ed25519 keys made
// with ssh-keygen:
//   client_key, client_key.pub   the one client identity; authorized_keys holds its .pub
//   host<i>_key[.pub]            host i's host key
//   known_hosts                  "node<i>,<addr(i)> <host i's key>" and the same for
//                                "node<i>-v6,<addr6(i)>": StrictHostKeyChecking stays on
//   ssh_config                   for `ssh -F <ssh_config> node1 CMD` (below)
//   sshd_config_<i>, sshd<i>.log host i's server configuration and its log (LogLevel VERBOSE)
//
// ssh_config (every host): User <current user>, IdentityFile client_key, IdentitiesOnly yes,
// IdentityAgent none, UserKnownHostsFile known_hosts, GlobalKnownHostsFile /dev/null,
// StrictHostKeyChecking yes, BatchMode yes, ConnectTimeout 5, LogLevel ERROR. With -F, ssh
// reads neither ~/.ssh/config nor /etc/ssh/ssh_config.
//
// sshd_config_<i>: Port 22 (the namespace is private), ListenAddress 0.0.0.0 and ::, its
// HostKey, AuthorizedKeysFile <dir>/authorized_keys, PidFile none, UsePAM no, StrictModes no,
// PermitRootLogin prohibit-password, PubkeyAuthentication yes, PasswordAuthentication no,
// KbdInteractiveAuthentication no, LogLevel VERBOSE, and no AcceptEnv (sshd's default: the
// client's environment is not taken). sshd runs in the foreground in host i through
// HostNet::wrap: `sshd -D -e -f <dir>/sshd_config_<i>`, exec'd (its pid is the listener's)
// with stdin and stdout on /dev/null and stderr appended to <dir>/sshd<i>.log, not a pipe:
// nobody drains a pipe while a test runs ssh, and a full one would stall sshd.
//
// Not thread-safe: use one SshHosts from one thread, with its HostNet outliving it.
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hostnet.h"
#include "proc.h"

namespace muster::testing {

class SshHosts {
 public:
  // Makes the keys and configurations and starts sshd in each of `hosts` (indices of `net`).
  // Creates /run/sshd (sshd's privilege separation folder) when missing. Returns once every
  // sshd answers with its SSH banner on addr(i):22, dialled from the root namespace (over the
  // bridge), within a deadline of 15 s; or an error saying why (a tool missing, ssh-keygen's
  // stderr, or the sshd that exited or did not answer, with its log).
  static absl::StatusOr<std::unique_ptr<SshHosts>> start(const HostNet& net,
                                                         const std::vector<int>& hosts,
                                                         const std::string& dir);

  // Ends each sshd still running and the sessions it still serves, by pid (pidfds): SIGTERM,
  // then SIGKILL after 5 s. Also the sessions that a stop() left running.
  ~SshHosts();
  SshHosts(const SshHosts&) = delete;
  SshHosts& operator=(const SshHosts&) = delete;

  // The client configuration's path: `ssh -F <path> node1 true`.
  const std::string& ssh_config() const { return ssh_config_; }
  // The client identity, for tests that build their own ssh options.
  std::string client_key() const { return dir_ + "/client_key"; }
  std::string known_hosts() const { return dir_ + "/known_hosts"; }
  // Host `host`'s sshd log (what it accepted and refused).
  std::string log_path(int host) const;

  // The listener's pid; -1 when `host` has none (not started here, or stopped).
  pid_t sshd_pid(int host) const;

  // Ends host `host`'s listener (SIGTERM, SIGKILL after 5 s): the host refuses connections
  // from then on (RST: ssh exits 255 at once). Sessions already open stay, as they do when a
  // real sshd is stopped; the destructor ends them. false when there was no listener to end.
  bool stop(int host);

 private:
  SshHosts() = default;

  std::string dir_;
  std::string ssh_config_;
  std::map<int, std::unique_ptr<Proc>> sshd_;  // host -> its listener
  std::vector<int> orphans_;                   // pidfds of sessions left by stop()
};

}  // namespace muster::testing
