// The TCPStore frame parser (rendezvous/src/common/tcpstore_protocol.h): dialects told apart by the
// first bytes, lengths checked as they arrive, prefixes that wait for more; and the address
// helpers the per-run listeners use.
#include <catch2/catch.hpp>
#include <cstring>
#include <string>

#include "common/tcpstore_protocol.h"
#include "muster/rendezvous/resolve.h"

namespace wire = muster::rendezvous::tcpstore;
using wire::Dialect;
using wire::Op;
using wire::Parsed;

namespace {

wire::FrameLimits limits() { return {64, 1024, 8, 4096}; }

wire::Request req(Op op, std::vector<std::string> keys, std::vector<std::string> values = {}) {
  wire::Request r;
  r.op = op;
  r.keys = std::move(keys);
  r.values = std::move(values);
  return r;
}

std::string u64(std::uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }

}  // namespace

TEST_CASE("tcpstore protocol: torch 2.x's handshake picks its dialect, anything else is 1.13",
          "[tcpstore]") {
  wire::Request v;
  v.op = Op::kValidate;
  v.number = wire::kValidationMagic;
  const std::string hello = wire::encode(Dialect::kTorch2, v);
  REQUIRE(hello.size() == 5);
  Dialect d = Dialect::kUnknown;
  wire::Request out;
  CHECK(wire::parse(d, hello.data(), 4, limits(), out).what == Parsed::kNeedMore);
  CHECK(d == Dialect::kUnknown);
  auto r = wire::parse(d, hello.data(), hello.size(), limits(), out);
  CHECK(r.what == Parsed::kRequest);
  CHECK(r.consumed == 5);
  CHECK(d == Dialect::kTorch2);
  CHECK(out.op == Op::kValidate);
  // In 2.x, byte 3 is GET; in 1.13 it is ADD.
  const std::string get = wire::encode(Dialect::kTorch2, req(Op::kGet, {"k"}));
  CHECK(get[0] == 3);
  REQUIRE(wire::parse(d, get.data(), get.size(), limits(), out).what == Parsed::kRequest);
  CHECK(out.op == Op::kGet);
  CHECK(out.keys == std::vector<std::string>{"k"});

  // A 1.13 SET (byte 0, then its key's length): not the magic, so 1.13.
  const std::string set = wire::encode(Dialect::kTorch1, req(Op::kSet, {"key"}, {"v"}));
  CHECK(set[0] == 0);
  Dialect d1 = Dialect::kUnknown;
  REQUIRE(wire::parse(d1, set.data(), set.size(), limits(), out).what == Parsed::kRequest);
  CHECK(d1 == Dialect::kTorch1);
  CHECK(out.op == Op::kSet);
  CHECK(out.values == std::vector<std::string>{"v"});
  CHECK(wire::wire_byte(Dialect::kTorch1, Op::kWatchKey) == 7);
  CHECK(wire::wire_byte(Dialect::kTorch2, Op::kWatchKey) == -1);
  CHECK(wire::wire_byte(Dialect::kTorch1, Op::kPing) == -1);
  CHECK(wire::wire_byte(Dialect::kTorch2, Op::kQueueLen) == 16);
}

TEST_CASE("tcpstore protocol: every prefix of a frame waits for more, and nothing is consumed",
          "[tcpstore]") {
  const std::string frame =
      wire::encode(Dialect::kTorch2, req(Op::kMultiSet, {"a", "bb"}, {"1", "22"}));
  for (std::size_t cut = 0; cut < frame.size(); ++cut) {
    Dialect d = Dialect::kTorch2;
    wire::Request out;
    auto r = wire::parse(d, frame.data(), cut, limits(), out);
    INFO("cut " << cut);
    CHECK(r.what == Parsed::kNeedMore);
    CHECK(r.consumed == 0);
  }
  Dialect d = Dialect::kTorch2;
  wire::Request out;
  auto r = wire::parse(d, frame.data(), frame.size(), limits(), out);
  REQUIRE(r.what == Parsed::kRequest);
  CHECK(out.keys == std::vector<std::string>{"a", "bb"});
  CHECK(out.values == std::vector<std::string>{"1", "22"});
}

TEST_CASE("tcpstore protocol: a length over a limit is an error before its bytes arrive",
          "[tcpstore][limits]") {
  wire::Request out;
  auto parse = [&](const std::string& bytes) {
    Dialect d = Dialect::kTorch2;
    return wire::parse(d, bytes.data(), bytes.size(), limits(), out);
  };
  const char get = static_cast<char>(wire::wire_byte(Dialect::kTorch2, Op::kGet));
  const char set = static_cast<char>(wire::wire_byte(Dialect::kTorch2, Op::kSet));
  const char check = static_cast<char>(wire::wire_byte(Dialect::kTorch2, Op::kCheck));
  auto r = parse(std::string(1, get) + u64(65));  // the key's bytes never sent
  CHECK(r.what == Parsed::kError);
  CHECK_THAT(r.error, Catch::Contains("GET: a key of 65 bytes (the limit is 64)"));
  r = parse(std::string(1, set) + u64(1) + "k" + u64(1025));
  CHECK(r.what == Parsed::kError);
  CHECK_THAT(r.error, Catch::Contains("a value of 1025 bytes"));
  r = parse(std::string(1, check) + u64(9));
  CHECK(r.what == Parsed::kError);
  CHECK_THAT(r.error, Catch::Contains("9 keys in one query (the limit is 8)"));
  // Within each field's limit but over the frame's: 8 values of 1024 bytes > 4096.
  std::string ms(1, static_cast<char>(wire::wire_byte(Dialect::kTorch2, Op::kMultiSet)));
  ms += u64(8);
  for (int i = 0; i < 4; ++i) ms += u64(1) + "k" + u64(1024) + std::string(1024, 'v');
  r = parse(ms);
  CHECK(r.what == Parsed::kError);
  CHECK_THAT(r.error, Catch::Contains("a frame over 4096 bytes"));
  r = parse(std::string(1, '\x40'));
  CHECK(r.what == Parsed::kError);
  CHECK_THAT(r.error, Catch::Contains("an unknown query type 64"));
  std::string bad_magic(1, '\0');
  const std::uint32_t m = 1234;
  bad_magic.append(reinterpret_cast<const char*>(&m), 4);
  r = parse(bad_magic);
  CHECK(r.what == Parsed::kError);
  CHECK_THAT(r.error, Catch::Contains("wrong magic"));
}

TEST_CASE("tcpstore protocol: host_of takes the host of an endpoint", "[tcpstore]") {
  using muster::rendezvous::host_of;
  CHECK(host_of("node0:29400") == "node0");
  CHECK(host_of("[fd00::1]:29400") == "fd00::1");
  CHECK(host_of("fd00::1") == "fd00::1");
  CHECK(host_of("node0") == "node0");
}
