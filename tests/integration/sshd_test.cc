// SshHosts (tests/support/sshd.h): real sshd in network-namespace hosts, real ssh clients
// between them, with the keys and known_hosts made for the test.
//
// Exits 77 (ctest: Skipped) where it cannot run: not root, namespaces cannot be made, or no
// /usr/sbin/sshd.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <regex>
#include <sstream>

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "hostnet.h"
#include "proc.h"
#include "skip.h"
#include "sshd.h"

using namespace muster::testing;

namespace {

struct Cluster {
  TempDir dir;
  std::unique_ptr<HostNet> net;
  std::unique_ptr<SshHosts> ssh;  // declared after net: ends its sshds before the hosts go
};

std::unique_ptr<Cluster> make_cluster(int n) {
  auto c = std::make_unique<Cluster>();
  auto net = HostNet::create(n);
  INFO((net.ok() ? std::string() : std::string(net.status().message())));
  REQUIRE(net.ok());
  c->net = std::move(*net);
  std::vector<int> hosts(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) hosts[static_cast<std::size_t>(i)] = i;
  auto ssh = SshHosts::start(*c->net, hosts, c->dir.file("ssh"));
  INFO((ssh.ok() ? std::string() : std::string(ssh.status().message())));
  REQUIRE(ssh.ok());
  c->ssh = std::move(*ssh);
  return c;
}

// `ssh -F <config> ARGS...` run in host `from`.
std::vector<std::string> ssh_from(const Cluster& c, int from, std::vector<std::string> args) {
  std::vector<std::string> argv{"ssh", "-F", c.ssh->ssh_config()};
  argv.insert(argv.end(), args.begin(), args.end());
  return c.net->wrap(from, argv);
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

bool in_host(const HostNet& net, int host, pid_t pid) {
  auto pids = ns_pids(net.ns(host));
  return std::find(pids.begin(), pids.end(), pid) != pids.end();
}

}  // namespace

TEST_CASE("ssh between namespace hosts: by name and by address, into that host") {
  auto c = make_cluster(2);
  {
    Proc p(ssh_from(*c, 0, {"node1", "hostname"}));
    auto code = p.wait(30s);
    INFO(p.err() << "\nsshd log: " << read_file(c->ssh->log_path(1)));
    REQUIRE(code == 0);
    CHECK(trimmed(p.out()) == "node1");
  }
  {
    Proc p(ssh_from(*c, 0, {c->net->addr(1), "hostname"}));
    auto code = p.wait(30s);
    INFO(p.err());
    REQUIRE(code == 0);
    CHECK(trimmed(p.out()) == "node1");
  }
  {
    // And the other way, and to itself: every host is a client and a server.
    Proc p(ssh_from(*c, 1, {"node0", "hostname"}));
    REQUIRE(p.wait(30s) == 0);
    CHECK(trimmed(p.out()) == "node0");
    Proc self(ssh_from(*c, 1, {"node1", "hostname"}));
    REQUIRE(self.wait(30s) == 0);
    CHECK(trimmed(self.out()) == "node1");
  }
  {
    // IPv6: the -v6 name and the address.
    Proc p(ssh_from(*c, 0, {"node1-v6", "hostname"}));
    auto code = p.wait(30s);
    INFO(p.err());
    CHECK(code == 0);
    CHECK(trimmed(p.out()) == "node1");
    Proc q(ssh_from(*c, 0, {c->net->addr6(1), "hostname"}));
    CHECK(q.wait(30s) == 0);
    CHECK(trimmed(q.out()) == "node1");
  }
  {
    // The remote command runs in host 1's network: it sees eth0 with host 1's address.
    Proc p(ssh_from(*c, 0, {"node1", "cat /proc/net/fib_trie"}));
    REQUIRE(p.wait(30s) == 0);
    CHECK(p.out().find(c->net->addr(1)) != std::string::npos);
    CHECK(p.out().find(c->net->addr(0)) == std::string::npos);
  }
  CHECK(c->ssh->sshd_pid(0) > 0);
  CHECK(c->ssh->sshd_pid(1) > 0);
  CHECK(c->ssh->sshd_pid(2) == -1);
  CHECK(in_host(*c->net, 1, c->ssh->sshd_pid(1)));
}

TEST_CASE("ssh: what a remote command gets (environment, exit status, stdin)") {
  auto c = make_cluster(2);
  // The client's environment does not travel (no SendEnv, no AcceptEnv); sshd sets its own.
  Proc env(ssh_from(*c, 0, {"node1", "env"}), {{"MUSTER_SSH_PROBE", "1"}});
  REQUIRE(env.wait(30s) == 0);
  INFO("remote env:\n" << env.out());
  CHECK(env.out().find("MUSTER_SSH_PROBE") == std::string::npos);
  // PATH: sshd's default for the user, and what the user's shell startup adds (Debian's bash
  // reads ~/.bashrc for a command from sshd).
  CHECK(std::regex_search(env.out(), std::regex("(^|\n)PATH=[^\n]*/usr/bin")));
  CHECK(std::regex_search(env.out(), std::regex("(^|\n)USER=root\n")));  // main() needs root
  CHECK(env.out().find("SSH_CONNECTION=" + c->net->addr(0) + " ") != std::string::npos);
  // The remote status comes back as ssh's own.
  Proc code(ssh_from(*c, 0, {"node1", "exit 7"}));
  CHECK(code.wait(30s) == 7);
}

TEST_CASE("ssh: the keys and known_hosts matter") {
  auto c = make_cluster(2);
  TempDir other;
  {
    // A key the host does not know: the host key is accepted, the login is refused.
    Proc keygen({"/usr/bin/ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", other.file("k")});
    REQUIRE(keygen.wait(30s) == 0);
    Proc p(c->net->wrap(
        0, {"ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o",
            "IdentityAgent=none", "-o", "IdentityFile=" + other.file("k"), "-o",
            "UserKnownHostsFile=" + c->ssh->known_hosts(), "-o", "StrictHostKeyChecking=yes", "-o",
            "ConnectTimeout=5", "node1", "hostname"}));
    auto code = p.wait(30s);
    INFO(p.err());
    CHECK(code == 255);
    CHECK(p.err().find("Permission denied (publickey)") != std::string::npos);
    CHECK(p.out().empty());
  }
  {
    // The right key with no known_hosts entry: StrictHostKeyChecking refuses the host.
    Proc p(ssh_from(*c, 0, {"-o", "UserKnownHostsFile=/dev/null", "node1", "hostname"}));
    auto code = p.wait(30s);
    INFO(p.err());
    CHECK(code == 255);
    CHECK(p.err().find("Host key verification failed") != std::string::npos);
    CHECK(p.out().empty());
  }
}

TEST_CASE("ssh: a stopped sshd refuses logins") {
  auto c = make_cluster(2);
  const pid_t sshd1 = c->ssh->sshd_pid(1);
  REQUIRE(sshd1 > 0);
  {
    Proc p(ssh_from(*c, 0, {"node1", "true"}));
    REQUIRE(p.wait(30s) == 0);
  }
  CHECK(c->ssh->stop(1));
  CHECK(c->ssh->sshd_pid(1) == -1);
  CHECK_FALSE(alive(sshd1));
  CHECK_FALSE(c->ssh->stop(1));
  Proc p(ssh_from(*c, 0, {"node1", "true"}));
  auto code = p.wait(30s);
  INFO(p.err());
  CHECK(code == 255);
  CHECK(p.err().find("Connection refused") != std::string::npos);
  // host 0's sshd is untouched.
  Proc q(ssh_from(*c, 1, {"node0", "true"}));
  CHECK(q.wait(30s) == 0);
}

TEST_CASE("ssh: killing the client (-9) ends a remote command that reads stdin") {
  auto c = make_cluster(2);
  {
    // The client's stdin is the command's: at EOF (here /dev/null), cat ends at once.
    std::vector<std::string> argv{"/bin/sh", "-c", "exec \"$@\" </dev/null", "sh"};
    for (const auto& a : ssh_from(*c, 0, {"node1", "exec cat"})) argv.push_back(a);
    Proc eof(argv);
    CHECK(eof.wait(30s) == 0);
  }
  // The client's stdin: a FIFO it holds open for reading and writing, so it never reaches EOF
  // (the test's own stdin may be /dev/null). sh execs ssh: the pid is the client's.
  const std::string fifo = c->dir.file("stdin");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::vector<std::string> argv{"/bin/sh", "-c", "exec \"$@\" <>\"$0\"", fifo};
  // The remote shell prints its pid, then becomes cat (same pid): cat blocks on stdin.
  for (const auto& a : ssh_from(*c, 0, {"node1", "echo pid $$; exec cat"})) argv.push_back(a);
  Proc client(argv);
  REQUIRE(client.wait_output([](const std::string& out,
                                const std::string&) { return out.find('\n') != std::string::npos; },
                             30s));
  std::smatch m;
  const std::string out = client.out();
  REQUIRE(std::regex_search(out, m, std::regex(R"(pid (\d+))")));
  const pid_t remote = std::stoi(m[1]);
  INFO("remote pid " << remote << ", comm " << read_file("/proc/" + m[1].str() + "/comm"));
  REQUIRE(in_host(*c->net, 1, remote));  // it runs in host 1
  // cat, once the exec is done (the pid printed it before exec'ing).
  int pidfd = open_pidfd(remote);
  REQUIRE(pidfd >= 0);
  CHECK_FALSE(wait_pidfd(pidfd, 300ms));  // still there while its client is
  REQUIRE(::kill(client.pid(), SIGKILL) == 0);
  CHECK(client.wait(10s) == 128 + SIGKILL);
  // The client's socket closes (FIN), sshd closes the command's stdin, cat reads EOF.
  CHECK(wait_pidfd(pidfd, 10s));
  ::close(pidfd);
  if (alive(remote) && in_host(*c->net, 1, remote)) ::kill(remote, SIGKILL);
}

TEST_CASE("ssh: killing the client (-9) leaves a remote command that ignores stdin running") {
  // What a driver must know: sshd ends the session, not the command. Without a pty nobody
  // sends the command a signal; it notices only when it reads stdin or writes its output.
  auto c = make_cluster(2);
  Proc client(ssh_from(*c, 0, {"node1", "echo pid $$; exec sleep 300"}));
  REQUIRE(client.wait_output([](const std::string& out,
                                const std::string&) { return out.find('\n') != std::string::npos; },
                             30s));
  std::smatch m;
  const std::string out = client.out();
  REQUIRE(std::regex_search(out, m, std::regex(R"(pid (\d+))")));
  const pid_t remote = std::stoi(m[1]);
  REQUIRE(in_host(*c->net, 1, remote));
  int remote_fd = open_pidfd(remote);
  REQUIRE(remote_fd >= 0);
  // Its parent is the session's sshd; that one ends with the connection.
  const std::string stat = read_file("/proc/" + m[1].str() + "/stat");
  std::istringstream rest(stat.substr(stat.rfind(')') + 1));
  std::string state;
  pid_t session = 0;
  rest >> state >> session;
  INFO("remote pid " << remote << ", its parent " << session << " ("
                     << trimmed(read_file("/proc/" + std::to_string(session) + "/comm")) << ")");
  int session_fd = open_pidfd(session);
  REQUIRE(session_fd >= 0);
  REQUIRE(::kill(client.pid(), SIGKILL) == 0);
  CHECK(client.wait(10s) == 128 + SIGKILL);
  CHECK(wait_pidfd(session_fd, 10s));                        // the session is gone
  CHECK_FALSE(wait_pidfd(remote_fd, 1s));                    // and the command is still running
  if (!wait_pidfd(remote_fd, 0ms)) ::kill(remote, SIGKILL);  // by pid, still ours to end
  CHECK(wait_pidfd(remote_fd, 10s));
  ::close(session_fd);
  ::close(remote_fd);
}

int main(int argc, char** argv) {
  if (::geteuid() != 0) {
    std::printf("skipped: needs root\n");
    return kSkipExit;
  }
  if (::access("/usr/sbin/sshd", X_OK) != 0) {
    std::printf("skipped: no /usr/sbin/sshd\n");
    return kSkipExit;
  }
  {
    auto probe = HostNet::create(1);
    if (!probe.ok()) {
      std::printf("skipped: %s\n", std::string(probe.status().message()).c_str());
      return kSkipExit;
    }
  }
  return catch_exit(Catch::Session().run(argc, argv));
}
