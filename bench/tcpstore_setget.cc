// The `store` row's set+get pairs from C++, on the TCPStore protocol instead of gRPC: what
// muster's own worker runtime would see if its store spoke the protocol PyTorch workers use
// (bench/run store; the peer's client is bench/tcpstore_client.py). A get is what torch's
// client does and what Store::get promises (block until the key exists): WAIT, then GET; a
// set has no reply. Same stdin handshake as `comm_bench store`: connects, prints "ready",
// waits for a line, then prints "store <ops> <seconds>".
//   tcpstore_setget PORT N ID
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "../tests/support/tcpstore_client.h"

namespace wire = muster::rendezvous::tcpstore;
using muster::testing::TcpStoreClient;

namespace {

bool get(TcpStoreClient& c, const std::string& key) {
  if (!c.send(TcpStoreClient::req(TcpStoreClient::Op::kWait, {key}))) return false;
  const auto stop = c.read_u8();
  if (!stop || *stop != wire::kStopWaiting) return false;
  return c.get(key).has_value();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: tcpstore_setget PORT N ID\n");
    return 2;
  }
  TcpStoreClient c(std::atoi(argv[1]), wire::Dialect::kTorch2);
  if (!c.ok()) {
    std::fprintf(stderr, "tcpstore_setget: cannot connect to port %s\n", argv[1]);
    return 1;
  }
  const int n = std::atoi(argv[2]);
  const std::string id = argv[3];
  const std::string value(16, 'v');
  if (!c.set(id + "/warm", value) || !get(c, id + "/warm")) return 1;
  std::printf("ready\n");
  std::fflush(stdout);
  std::string line;
  if (!std::getline(std::cin, line)) return 1;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    const std::string key = id + "/" + std::to_string(i);
    if (!c.set(key, value) || !get(c, key)) return 1;
  }
  std::printf("store %d %.6f\n", 2 * n,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
