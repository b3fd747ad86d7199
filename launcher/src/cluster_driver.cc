#include "cluster_driver.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "muster/agent/failure.h"
#include "muster/agent/line_splitter.h"
#include "muster/agent/process.h"
#include "muster/agent/worker_env.h"
#include "muster/launcher/cluster.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/resolve.h"
#include "muster/rendezvous/server.h"

namespace muster::launcher {
namespace {

namespace asio = boost::asio;
namespace limits = muster::rendezvous::limits;
using Descriptor = asio::posix::stream_descriptor;
using muster::agent::write_all;

std::string random_hex(int bytes) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < bytes; ++i) absl::StrAppendFormat(&out, "%02x", rd() & 0xff);
  return out;
}

std::string strip_user(const std::string& host) {
  const auto at = host.find('@');
  return at == std::string::npos ? host : host.substr(at + 1);
}

// The address of this machine that a peer at `addresses` (resolve_host's) reaches it by: the
// source address the kernel picks for a route to the first (a UDP connect sends nothing).
// Empty when there is none.
std::string source_address_towards(const std::vector<std::string>& addresses) {
  if (addresses.empty()) return "";
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(addresses.front().c_str(), "9", &hints, &res) != 0) return "";
  std::string out;
  const int fd = ::socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* a = local.ss_family == AF_INET6
                        ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                        : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
    if (::inet_ntop(local.ss_family, a, text, sizeof text) != nullptr) out = text;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

// Whether `host` (looked up as `addresses`) is this machine.
bool names_this_machine(const std::string& host, const std::vector<std::string>& addresses) {
  if (host == "localhost" || host == "127.0.0.1" || host == "::1") return true;
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) == 0 && host == name) return true;
  return muster::rendezvous::is_local_address(addresses);
}

class Driver {
 public:
  Driver(const LaunchConfig& cfg, asio::io_context& io, muster::agent::JobSupervisor* supervisor)
      : cfg_(cfg), io_(io), supervisor_(supervisor), stop_timer_(io) {}

  int run(std::function<void(int)>& on_signal) {
    // Each host is looked up once (bounded: resolve.h); a name the resolver does not know may
    // still be an ssh-config alias, left to ssh.
    std::map<std::string, std::vector<std::string>> addresses;
    for (const HostSlots& h : cfg_.cluster.hosts) {
      const std::string name = strip_user(h.host);
      if (addresses.count(name) > 0) continue;
      auto found = muster::rendezvous::resolve_host(name);
      addresses[name] = found.ok() ? *found : std::vector<std::string>{};
    }
    auto is_local = [&addresses](const std::string& name) {
      return names_this_machine(name, addresses[name]);
    };
    ClusterPlanInput in;
    env_ = muster::agent::current_environment();
    in.env = env_;
    in.is_local = is_local;
    const char* path = std::getenv("PATH");
    ssh_ = find_executable("ssh", path != nullptr ? path : "/usr/bin:/bin");
    in.run_id = cfg_.rdzv_id.empty() ? absl::StrCat("hosts-", random_hex(8)) : cfg_.rdzv_id;
    in.token = cfg_.rdzv_conf.token;
    std::error_code ec;
    in.cwd = std::filesystem::current_path(ec).string();
    in.launch_path = cfg_.cluster.remote_launch;
    if (in.launch_path.empty()) {
      in.launch_path = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    }
    // The rendezvous: --rdzv_endpoint's, else a server here, on every interface, on a port the
    // kernel picks, reached by the address this machine has towards the hosts.
    std::unique_ptr<muster::rendezvous::RendezvousServer> server;
    if (!cfg_.rdzv_endpoint.empty()) {
      in.endpoint = cfg_.endpoint.to_string();
      for (const Endpoint& e : cfg_.more_endpoints) in.endpoint += "," + e.to_string();
    } else {
      std::string advertised;
      bool any_remote = false;
      for (const HostSlots& h : cfg_.cluster.hosts) {
        const std::string name = strip_user(h.host);
        if (is_local(name)) continue;
        any_remote = true;
        advertised = source_address_towards(addresses[name]);
        if (!advertised.empty()) break;
      }
      if (!any_remote) {
        advertised = "127.0.0.1";
      } else if (advertised.empty()) {
        advertised = muster::rendezvous::fully_qualified_hostname();  // ssh-config aliases
      }
      const bool v6 = advertised.find(':') != std::string::npos;
      if (in.token.empty()) in.token = random_hex(16);  // only this command's agents may join
      muster::rendezvous::ServerOptions opts;
      opts.listen_address = !any_remote ? "127.0.0.1:0" : v6 ? "[::]:0" : "0.0.0.0:0";
      opts.token = in.token;
      opts.tls = cfg_.server_tls;
      opts.timeouts = cfg_.rdzv_conf.timeouts;
      auto started = muster::rendezvous::RendezvousServer::start(io_, opts);
      if (!started.ok()) {
        std::fprintf(stderr, "launch: error: %s\n", std::string(started.status().message()).c_str());
        return 1;
      }
      server = std::move(*started);
      in.endpoint = Endpoint{advertised, server->port()}.to_string();
      in.hosted = true;
      spdlog::info("hosting the rendezvous on {} for {} hosts (run {})", in.endpoint,
                   cfg_.cluster.hosts.size(), in.run_id);
    }

    on_signal = [this](int sig) { stop(sig); };
    for (HostCommand& c : plan_hosts(cfg_, in)) start(std::move(c));
    if (live_ == 0) finish();
    io_.run();

    if (server) {
      std::thread closer([&] {
        server->shutdown(std::chrono::milliseconds(0));  // every agent has ended
        asio::post(io_, [this] { io_.stop(); });
      });
      io_.restart();
      io_.run();
      closer.join();
    }
    return exit_code();
  }

 private:
  struct Stream {
    explicit Stream(asio::io_context& io, int fd, std::string prefix, int console)
        : sd(io, fd), lines(std::move(prefix)), console(console) {}
    Descriptor sd;
    muster::agent::LineSplitter lines;
    int console;
    std::array<char, 16 << 10> buf{};
    std::string out;
    std::string last_line;  // ssh's reason, when it fails
  };
  struct Host {
    HostCommand cmd;
    pid_t pid = -1;
    int in_fd = -1;  // the agent's stdin: open while the driver wants it to run
    std::unique_ptr<Descriptor> pidfd;
    std::unique_ptr<Stream> out, err;
    int open_streams = 0;
    bool exited = false;
    bool done = false;  // exited and its output read to the end
    bool signaled = false;  // killed by a signal (rather than exiting with 128+N itself)
    int code = 0;
    bool lost = false;
  };

  void start(HostCommand cmd) {
    auto h = std::make_unique<Host>();
    h->cmd = std::move(cmd);
    muster::agent::SpawnRequest req;
    req.argv = h->cmd.argv;
    if (h->cmd.local) {
      req.path = h->cmd.argv.front();
    } else if (ssh_.ok()) {
      req.path = *ssh_;
    } else {
      not_started(std::move(h), "cannot start ssh", ssh_.status());
      return;
    }
    std::map<std::string, std::string> env = env_;
    for (const auto& [k, v] : h->cmd.env) env[k] = v;
    req.envp = muster::agent::to_envp(env);
    req.stdin_mode = muster::agent::SpawnRequest::Stdin::kPipe;
    req.cgroup_procs_fd = supervisor_ != nullptr ? supervisor_->cgroup_procs_fd() : -1;
    auto child = muster::agent::spawn_worker(req);
    if (!child.ok()) {
      not_started(std::move(h), "cannot start its agent", child.status());
      return;
    }
    if (supervisor_ != nullptr) supervisor_->track_group(child->pid);
    h->pid = child->pid;
    h->in_fd = child->in_fd;
    h->pidfd = std::make_unique<Descriptor>(io_, child->pidfd);
    const std::string prefix = strip_user(h->cmd.host) + ": ";
    h->out = std::make_unique<Stream>(io_, child->out_fd, prefix, STDOUT_FILENO);
    h->err = std::make_unique<Stream>(io_, child->err_fd, prefix, STDERR_FILENO);
    h->open_streams = 2;
    spdlog::info("host {}: agent started ({}, pid {})", h->cmd.host,
                 h->cmd.local ? "this machine" : "ssh", h->pid);
    Host* raw = h.get();
    hosts_.push_back(std::move(h));
    ++live_;
    read(raw, raw->out.get());
    read(raw, raw->err.get());
    watch_exit(raw);
  }

  // A host whose agent could not even be started: lost at once.
  void not_started(std::unique_ptr<Host> h, const char* what, const absl::Status& why) {
    spdlog::error("host {}: {}: {}", h->cmd.host, what, std::string(why.message()));
    h->exited = h->lost = true;
    h->code = 255;
    hosts_.push_back(std::move(h));
    on_lost(*hosts_.back());
  }

  void read(Host* h, Stream* s) {
    s->sd.async_read_some(asio::buffer(s->buf), [this, h, s](const boost::system::error_code& ec,
                                                             std::size_t n) {
      s->out.clear();
      if (!ec) {
        s->lines.feed(std::string_view(s->buf.data(), n), s->out);
      } else {
        s->lines.finish(s->out);
      }
      if (!s->out.empty()) {
        write_all(s->console, s->out);
        // The last whole line, without its prefix: ssh's own error when it fails.
        std::string_view text(s->out);
        text.remove_suffix(1);
        const auto nl = text.rfind('\n');
        if (nl != std::string_view::npos) text.remove_prefix(nl + 1);
        text.remove_prefix(std::min(text.size(), s->lines.prefix().size()));
        s->last_line = std::string(text);
      }
      if (!ec) {
        read(h, s);
        return;
      }
      boost::system::error_code ignored;
      s->sd.close(ignored);
      --h->open_streams;
      maybe_done(*h);
    });
  }

  void watch_exit(Host* h) {
    h->pidfd->async_wait(Descriptor::wait_read, [this, h](const boost::system::error_code& ec) {
      if (ec) return;
      int status = 0;
      if (::waitpid(h->pid, &status, WNOHANG) == 0) {
        watch_exit(h);
        return;
      }
      h->pidfd->close();
      if (supervisor_ != nullptr) supervisor_->forget_group(h->pid);
      h->exited = true;
      h->signaled = WIFSIGNALED(status);
      h->code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      maybe_done(*h);
    });
  }

  // A host is done once its agent (or ssh) has exited and its output has been read to the end.
  void maybe_done(Host& h) {
    if (h.done || !h.exited || h.open_streams > 0) return;
    h.done = true;
    if (h.in_fd >= 0) ::close(h.in_fd);
    h.in_fd = -1;
    --live_;
    // ssh's own failures (cannot connect, login refused, the connection lost) are 255; an ssh
    // client or a local agent killed by a signal is lost the same way. A job's failure (the
    // agent's exit code) is not a lost host.
    if (stop_signal_ == 0 && (h.signaled || (!h.cmd.local && h.code == 255))) {
      h.lost = true;
      on_lost(h);
    } else if (h.code != 0) {
      spdlog::info("host {}: agent ended with exit code {}", h.cmd.host, h.code);
    }
    if (live_ == 0) finish();
  }

  void on_lost(Host& h) {
    ++lost_;
    const int total = static_cast<int>(cfg_.cluster.hosts.size());
    const int left = total - lost_;
    const std::string why = h.err && !h.err->last_line.empty()
                                ? h.err->last_line
                                : absl::StrCat("exit code ", h.code);
    if (left < cfg_.min_nodes && !too_few_) {
      too_few_ = true;
      std::fprintf(stderr,
                   "launch: error: host %s is lost (%s); %d of %d hosts left, fewer than the %d "
                   "the job needs (--nnodes); stopping every host\n",
                   h.cmd.host.c_str(), why.c_str(), left, total, cfg_.min_nodes);
      stop_hosts(SIGTERM);
    } else if (!too_few_) {
      spdlog::warn("host {} is lost ({}); {} of {} hosts left, the job goes on (--nnodes={}:{})",
                   h.cmd.host, why, left, total, cfg_.min_nodes, cfg_.max_nodes);
    }
  }

  // A signal to launch: every host's agent stops its workers (its stdin ends; a local agent is
  // given the signal itself). A second signal, or agents still running after the workers'
  // shutdown timeout and a margin, end the ssh sessions (and so the agents) at once.
  void stop(int sig) {
    if (stop_signal_ != 0) {
      spdlog::warn("received {} again; ending every host's session now",
                   muster::agent::signal_name(sig));
      kill_hosts(SIGKILL);
      return;
    }
    stop_signal_ = sig;
    spdlog::warn("received {}; stopping every host", muster::agent::signal_name(sig));
    stop_hosts(sig);
  }

  void stop_hosts(int sig) {
    for (auto& h : hosts_) {
      if (h->exited) continue;
      if (h->cmd.local) {
        ::kill(h->pid, sig);  // its stdin stays open: the end of it would be a second stop
      } else if (h->in_fd >= 0) {
        ::close(h->in_fd);  // the remote agent's stdin ends: it stops (MUSTER_STDIN_WATCH)
        h->in_fd = -1;
      }
    }
    stop_timer_.expires_after(cfg_.shutdown_timeout + limits::kClusterStopMargin);
    stop_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      spdlog::warn("agents still running {} s after the stop; ending their sessions",
                   std::chrono::duration_cast<std::chrono::seconds>(cfg_.shutdown_timeout +
                                                                    limits::kClusterStopMargin)
                       .count());
      kill_hosts(SIGKILL);
    });
  }

  void kill_hosts(int sig) {
    for (auto& h : hosts_) {
      if (h->pid > 0 && !h->exited) ::kill(h->pid, sig);
    }
  }

  void finish() {
    stop_timer_.cancel();
    asio::post(io_, [this] { io_.stop(); });
  }

  int exit_code() const {
    if (stop_signal_ != 0) return 128 + stop_signal_;
    if (too_few_) return 1;
    for (const auto& h : hosts_) {
      if (!h->lost && h->code != 0) return h->code;
    }
    return lost_ == static_cast<int>(hosts_.size()) ? 1 : 0;
  }

  const LaunchConfig& cfg_;
  asio::io_context& io_;
  muster::agent::JobSupervisor* supervisor_;
  asio::steady_timer stop_timer_;
  std::vector<std::unique_ptr<Host>> hosts_;
  std::map<std::string, std::string> env_;  // this process's, looked up once
  absl::StatusOr<std::string> ssh_;         // ssh on PATH, looked up once
  int live_ = 0;
  int lost_ = 0;
  bool too_few_ = false;
  int stop_signal_ = 0;
};

}  // namespace

int run_cluster(const LaunchConfig& cfg, asio::io_context& io, std::function<void(int)>& on_signal,
                muster::agent::JobSupervisor* supervisor) {
  Driver driver(cfg, io, supervisor);
  return driver.run(on_signal);
}

}  // namespace muster::launcher
