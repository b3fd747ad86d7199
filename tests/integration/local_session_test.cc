// What launch --standalone runs on: the embedded server's in-process sessions
// (muster/rendezvous/local_session.h) and its gRPC started on demand
// (ServerOptions::start_grpc_on_demand, server/on_demand.h).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <optional>
#include <thread>
#include <vector>

#include "muster/rendezvous/client.h"
#include "muster/rendezvous/grpc_store.h"
#include "muster/rendezvous/server.h"
#include "muster/v1/rendezvous.grpc.pb.h"
#include "server/on_demand.h"

namespace rdzv = muster::rendezvous;
namespace v1 = muster::v1;
using namespace std::chrono_literals;

namespace {

v1::AgentMsg join(const std::string& node, const std::string& token = "") {
  v1::AgentMsg m;
  v1::Join* j = m.mutable_join();
  j->set_run_id("run");
  j->set_node_id(node);
  j->set_host("host-" + node);
  j->set_local_world_size(2);
  j->set_min_nodes(1);
  j->set_max_nodes(1);
  j->set_token(token);
  return m;
}

// Runs the loop until pred() holds; false after `limit`.
template <class P>
bool run_until(boost::asio::io_context& io, P pred, std::chrono::milliseconds limit = 10s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    io.restart();
    io.run_for(5ms);
  }
  return true;
}

std::optional<v1::RunStatus> status_of(boost::asio::io_context& io, rdzv::RendezvousServer& s) {
  std::optional<v1::StatusReply> reply;
  s.post_status("run", [&](v1::StatusReply r) { reply = std::move(r); });
  if (!run_until(io, [&] { return reply.has_value(); }) || reply->runs_size() == 0) {
    return std::nullopt;
  }
  return reply->runs(0);
}

struct Seen {
  std::vector<v1::ServerMsg> msgs;
  std::optional<absl::Status> closed;
  rdzv::LocalServer::Handlers handlers() {
    return {[this](const v1::ServerMsg& m) { msgs.push_back(m); },
            [this](const absl::Status& s) { closed = s; }};
  }
  bool assigned() const { return !msgs.empty() && msgs.back().has_assignment(); }
};

bool refused(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  const bool r =
      ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno == ECONNREFUSED;
  ::close(fd);
  return r;
}

// A server as launch --standalone runs it (gRPC on demand), with `token` when given.
std::unique_ptr<rdzv::RendezvousServer> embedded(boost::asio::io_context& io,
                                                 const std::string& token = "") {
  rdzv::ServerOptions opts;
  opts.start_grpc_on_demand = true;
  opts.token = token;
  auto server = rdzv::RendezvousServer::start(io, opts);
  REQUIRE(server.ok());
  return std::move(*server);
}

}  // namespace

TEST_CASE(
    "local session: an in-process agent joins and is assigned, and its close is a node leaving",
    "[local_session]") {
  boost::asio::io_context io;
  auto server = embedded(io);
  Seen seen;
  auto stream = server->local()->open(seen.handlers());
  REQUIRE(stream->send(join("a")));
  REQUIRE(run_until(io, [&] { return seen.assigned(); }));
  const v1::Assignment& a = seen.msgs.back().assignment();
  CHECK(a.group_rank() == 0);
  CHECK(a.world_size() == 2);
  CHECK_FALSE(a.store_local_target().empty());  // the workers' store, on demand
  auto running = status_of(io, *server);
  REQUIRE(running);
  CHECK(running->phase() == "running");
  CHECK(running->members_size() == 1);

  // The agent closes: the server sees its node go, and the agent hears nothing more.
  stream->close();
  CHECK_FALSE(stream->send(join("a")));
  REQUIRE(run_until(io, [&] {
    auto st = status_of(io, *server);
    return !st || st->members_size() == 0;
  }));
  CHECK_FALSE(seen.closed.has_value());
  server->shutdown();
}

TEST_CASE("local session: the same edge as a stream: a wrong token and an oversized message end it",
          "[local_session]") {
  boost::asio::io_context io;
  auto server = embedded(io, "secret");

  Seen wrong;
  auto s1 = server->local()->open(wrong.handlers());
  CHECK_FALSE(s1->send(join("a", "guess")));
  REQUIRE(run_until(io, [&] { return wrong.closed.has_value(); }));
  CHECK(wrong.closed->code() == absl::StatusCode::kPermissionDenied);
  CHECK(wrong.msgs.empty());

  Seen big;
  auto s2 = server->local()->open(big.handlers());
  v1::AgentMsg huge = join("b", "secret");
  huge.mutable_join()->set_host(std::string(rdzv::limits::kMaxAgentMessageBytes, 'x'));
  CHECK_FALSE(s2->send(huge));
  REQUIRE(run_until(io, [&] { return big.closed.has_value(); }));
  CHECK(big.closed->code() == absl::StatusCode::kResourceExhausted);

  Seen right;
  auto s3 = server->local()->open(right.handlers());
  REQUIRE(s3->send(join("c", "secret")));
  REQUIRE(run_until(io, [&] { return right.assigned(); }));

  // A shutdown ends the open session (UNAVAILABLE) and refuses a new one.
  server->shutdown();
  REQUIRE(run_until(io, [&] { return right.closed.has_value(); }));
  CHECK(right.closed->code() == absl::StatusCode::kUnavailable);
  Seen late;
  auto s4 = server->local()->open(late.handlers());
  REQUIRE(run_until(io, [&] { return late.closed.has_value(); }));
  CHECK(late.closed->code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("local session: a SessionClient given the local server needs no socket",
          "[local_session]") {
  boost::asio::io_context io;
  auto server = embedded(io);
  std::vector<v1::ServerMsg> got;
  bool ready = false;
  rdzv::SessionClient client(
      io, [&](const v1::ServerMsg& m) { got.push_back(m); }, [](const absl::Status&) {});
  rdzv::SessionClient::OpenOptions o;
  o.target = "ipv4:192.0.2.1:9";  // unroutable: never dialled
  o.local = server->local();
  o.on_ready = [&] { ready = true; };
  client.open(o);
  REQUIRE(client.send(join("a")));
  REQUIRE(run_until(io, [&] { return ready && !got.empty() && got.back().has_assignment(); }));
  client.close();
  server->shutdown();
}

TEST_CASE(
    "on demand: gRPC starts with the first connection, serves TCP and the local socket, "
    "and the port refuses after the shutdown",
    "[local_session]") {
  boost::asio::io_context io;
  auto server = embedded(io);
  const int port = server->port();
  REQUIRE(port > 0);
  // The run's tables open with its first Assignment.
  Seen seen;
  auto stream = server->local()->open(seen.handlers());
  REQUIRE(stream->send(join("a")));
  REQUIRE(run_until(io, [&] { return seen.assigned(); }));

  // A status call and store calls, over TCP and over the abstract socket; the io thread runs
  // beside them (status calls are answered there).
  std::atomic<bool> done{false};
  std::thread loop([&] {
    while (!done) {
      io.restart();
      io.run_for(5ms);
    }
  });
  auto st = rdzv::get_status("127.0.0.1:" + std::to_string(port), "run", "", 10s);
  CHECK(st.ok());
  for (const std::string& target :
       {"127.0.0.1:" + std::to_string(port), server->local_store_target()}) {
    INFO(target);
    rdzv::GrpcStoreOptions so;
    so.target = target;
    so.run_id = "run";
    rdzv::GrpcStore store(so);
    CHECK(store.set("k", target).ok());
    auto v = store.get("k", 10s);
    REQUIRE(v.ok());
    CHECK(*v == target);
  }
  done = true;
  loop.join();
  server->shutdown();
  CHECK(refused(port));
}

TEST_CASE("on demand: the listener builds nothing until a connection comes, then once",
          "[local_session]") {
  using muster::rendezvous::server_internal::OnDemandListener;
  std::atomic<int> builds{0};
  // A server needs a service to start: one whose every method is unimplemented.
  v1::Rendezvous::CallbackService unimplemented;
  auto build = [&builds, &unimplemented] {
    ++builds;
    grpc::ServerBuilder b;
    b.RegisterService(&unimplemented);
    return b.BuildAndStart();
  };
  {
    auto idle = OnDemandListener::open("127.0.0.1:0", "", build);
    REQUIRE(idle.ok());
    (*idle)->stop();
    CHECK(builds == 0);
    CHECK((*idle)->server() == nullptr);
    CHECK(refused((*idle)->port()));
  }
  auto l = OnDemandListener::open("127.0.0.1:0", "", build);
  REQUIRE(l.ok());
  for (int i = 0; i < 3; ++i) {
    // Any call: the server has no service, so it answers UNIMPLEMENTED, which proves it read it.
    auto st = rdzv::get_status("127.0.0.1:" + std::to_string((*l)->port()), "", "", 10s);
    CHECK(st.status().code() == absl::StatusCode::kUnimplemented);
  }
  (*l)->stop();
  CHECK(builds == 1);
  REQUIRE((*l)->server() != nullptr);
  (*l)->server()->Shutdown();
  l->reset();  // before the service it serves

  CHECK_FALSE(OnDemandListener::open("localhost:0", "", build).ok());  // IPv4 literals only
}

TEST_CASE("on demand: out of descriptors, the listener waits instead of spinning, then serves",
          "[local_session]") {
  using muster::rendezvous::server_internal::OnDemandListener;
  v1::Rendezvous::CallbackService unimplemented;
  auto l = OnDemandListener::open("127.0.0.1:0", "", [&unimplemented] {
    grpc::ServerBuilder b;
    b.RegisterService(&unimplemented);
    return b.BuildAndStart();
  });
  REQUIRE(l.ok());
  // This process may open no descriptor more; then a client (its socket made before)
  // connects, which the kernel completes from the backlog: the listener's accept fails with
  // EMFILE.
  const int client = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>((*l)->port()));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  int open_fds = 0;
  for (int fd = 0; fd < 65536; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1) open_fds = fd + 1;
  }
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(open_fds);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  std::vector<int> fillers;  // the free descriptors below the limit, taken
  for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) fillers.push_back(fd);
  REQUIRE(errno == EMFILE);
  REQUIRE(::connect(client, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  auto cpu = [] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
  };
  // What is measured is time passing with the connection pending: a spinning accept loop
  // burns the whole of it, the backoff a few accept calls.
  const double before = cpu();
  std::this_thread::sleep_for(500ms);
  const double spent = cpu() - before;
  for (int fd : fillers) ::close(fd);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &saved) == 0);
  CHECK(spent < 100);
  // With descriptors again, the connection is taken and served.
  auto st = rdzv::get_status("127.0.0.1:" + std::to_string((*l)->port()), "", "", 10s);
  CHECK(st.status().code() == absl::StatusCode::kUnimplemented);
  ::close(client);
  (*l)->stop();
  if ((*l)->server() != nullptr) (*l)->server()->Shutdown();
  l->reset();
}

