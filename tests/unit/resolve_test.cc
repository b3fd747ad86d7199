// Name lookups through the system resolver (rendezvous/resolve.h).
#include "muster/rendezvous/resolve.h"

#include <catch2/catch.hpp>

using muster::rendezvous::grpc_address_target;
using muster::rendezvous::is_local_address;
using muster::rendezvous::resolve_host;

TEST_CASE("resolve: an address is itself, without a lookup", "[resolve]") {
  for (const std::string a : {"127.0.0.1", "198.18.0.7", "::1", "2001:db8::5"}) {
    auto r = resolve_host(a, std::chrono::milliseconds(0));  // no time at all: no lookup made
    REQUIRE(r.ok());
    CHECK(*r == std::vector<std::string>{a});
  }
}

TEST_CASE("resolve: localhost comes from /etc/hosts", "[resolve]") {
  auto r = resolve_host("localhost");
  REQUIRE(r.ok());
  REQUIRE_FALSE(r->empty());
  for (const std::string& a : *r) CHECK((a == "127.0.0.1" || a == "::1"));
  CHECK(is_local_address(*r));
}

TEST_CASE("resolve: gRPC targets name the family", "[resolve]") {
  CHECK(grpc_address_target("10.0.0.1", 29400) == "ipv4:10.0.0.1:29400");
  CHECK(grpc_address_target("fd00::1", 29400) == "ipv6:[fd00::1]:29400");
}

TEST_CASE("resolve: addresses of no interface here are not local", "[resolve]") {
  CHECK_FALSE(is_local_address({"192.0.2.1"}));  // TEST-NET-1
  CHECK_FALSE(is_local_address({}));
  CHECK(is_local_address({"192.0.2.1", "127.0.0.1"}));
}
