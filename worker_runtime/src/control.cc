#include "muster/worker/control.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "muster/ops/control_channel.h"

namespace muster::worker {

namespace control = ops::control;

absl::StatusOr<World> parse_world(const std::string& packet) {
  auto m = control::parse(packet);
  if (!m || m->kind != control::kWorld) {
    return absl::InvalidArgumentError("control channel: not a world message");
  }
  World w;
  struct Field {
    const char* key;
    int* into;
    int min;
  };
  const Field fields[] = {{"round", &w.round, 1},
                          {"rank", &w.rank, 0},
                          {"world_size", &w.world_size, 1},
                          {"local_rank", &w.local_rank, 0},
                          {"local_world_size", &w.local_world_size, 1},
                          {"group_rank", &w.group_rank, 0},
                          {"group_world_size", &w.group_world_size, 1},
                          {"restart_count", &w.restart_count, 0},
                          {"master_port", &w.master_port, 0}};
  for (const Field& f : fields) {
    auto v = m->number(f.key);
    if (!v || *v < f.min || *v > (1LL << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat("control channel: world message: bad or missing ", f.key));
    }
    *f.into = static_cast<int>(*v);
  }
  if (w.rank >= w.world_size || w.local_rank >= w.local_world_size ||
      w.group_rank >= w.group_world_size) {
    return absl::InvalidArgumentError("control channel: world message: a rank out of its range");
  }
  w.master_addr = m->text("master_addr");
  const std::string lost = m->text("lost");
  if (!lost.empty() && lost != "-") {
    for (absl::string_view r : absl::StrSplit(lost, ',')) {
      int x = 0;
      if (!absl::SimpleAtoi(r, &x) || x < 0) {
        return absl::InvalidArgumentError("control channel: world message: bad lost list");
      }
      w.lost.push_back(x);
    }
  }
  return w;
}

ControlChannel::ControlChannel(int fd) : fd_(fd) {
  reader_ = std::thread([this] { read_loop(); });
}

ControlChannel::~ControlChannel() {
  ::shutdown(fd_, SHUT_RDWR);  // wakes the reader's recv()
  if (reader_.joinable()) reader_.join();
  ::close(fd_);
}

absl::Status ControlChannel::send(const std::string& packet) {
  if (::send(fd_, packet.data(), packet.size(), MSG_NOSIGNAL) < 0) {
    return absl::UnavailableError(
        absl::StrCat("control channel: cannot write to the agent: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status ControlChannel::send_hello() {
  return send(control::encode({control::kHello, {{"in_place", "1"}}}));
}

absl::Status ControlChannel::send_resumed(int round) {
  return send(control::encode({control::kResumed, {{"round", std::to_string(round)}}}));
}

void ControlChannel::watch(Communicator* c) {
  std::lock_guard<std::mutex> lock(mu_);
  watched_.insert(c);
}

void ControlChannel::forget(Communicator* c) {
  std::lock_guard<std::mutex> lock(mu_);
  watched_.erase(c);
}

std::uint64_t ControlChannel::epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

absl::StatusOr<World> ControlChannel::await_world(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [this] { return pending_.has_value() || closed_; });
  if (pending_) {
    World w = std::move(*pending_);
    pending_.reset();
    return w;
  }
  if (closed_) return absl::UnavailableError("control channel: the agent closed it");
  return absl::DeadlineExceededError(absl::StrCat(
      "control channel: no new world from the agent within ", timeout.count(), " ms"));
}

// Blocked in recv() until the agent writes (no thread spins): each packet is one message.
void ControlChannel::read_loop() {
  char buf[control::kMaxMessageBytes + 1];
  for (;;) {
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    const std::string packet(buf, static_cast<std::size_t>(n));
    auto m = control::parse(packet);
    if (!m) {
      std::fprintf(stderr, "muster: control channel: ignored a malformed message\n");
      continue;
    }
    std::optional<World> world;
    if (m->kind == control::kWorld) {
      auto w = parse_world(packet);
      if (!w.ok()) {
        std::fprintf(stderr, "muster: %s\n", std::string(w.status().message()).c_str());
        continue;
      }
      world = std::move(*w);
    } else if (m->kind != control::kAbort) {
      continue;  // a kind this runtime does not know: nothing to do
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++epoch_;
    for (Communicator* c : watched_) c->abort();
    if (world) {
      world->epoch = epoch_;
      pending_ = std::move(world);
    }
    cv_.notify_all();
  }
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  cv_.notify_all();
}

}  // namespace muster::worker
