// Per-run credentials: the token file's parser, the table's rules, and the store's use of it.
#include "muster/rendezvous/credentials.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <string>

#include "muster/rendezvous/limits.h"
#include "proc.h"
// Private to the rendezvous library; the tests drive it directly.
#include "../../rendezvous/src/store/store_core.h"

using muster::rendezvous::Credentials;
using muster::rendezvous::load_token_file;
using muster::rendezvous::parse_token_file;
using muster::rendezvous::RunTokens;

namespace {

std::string error_of(const std::string& text) {
  auto r = parse_token_file(text, "tokens.txt");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(r.status().message());
}

}  // namespace

TEST_CASE("token file: runs, blanks, comments and CRLF", "[credentials]") {
  auto r = parse_token_file(
      "# run id   token\n"
      "\n"
      "job-a s3cret-a\n"
      "  job-b\t\ts3cret-b   # team b\r\n"
      "   # indented comment\n"
      "job-c s3cret-c",  // no newline at the end
      "tokens.txt");
  REQUIRE(r.ok());
  CHECK(*r == RunTokens{{"job-a", "s3cret-a"}, {"job-b", "s3cret-b"}, {"job-c", "s3cret-c"}});
  auto empty = parse_token_file("# nothing yet\n\n", "tokens.txt");
  REQUIRE(empty.ok());
  CHECK(empty->empty());
}

TEST_CASE("token file: errors name the file and the line", "[credentials]") {
  CHECK(error_of("a x\nlonely\n") == "tokens.txt line 2: expected 'RUN_ID TOKEN', got a run id alone");
  CHECK(error_of("a x\nb # comment\n") ==
        "tokens.txt line 2: expected 'RUN_ID TOKEN', got a run id alone");
  CHECK(error_of("\n\na x y\n") ==
        "tokens.txt line 3: expected 'RUN_ID TOKEN' (a comment after them starts with '#')");
  CHECK(error_of("a x\nb y\na z\n") == "tokens.txt line 3: run 'a' is already listed on line 1");
  CHECK(error_of("a \xff\xfe\n") == "tokens.txt line 1: not valid UTF-8");
  const std::string long_id(muster::rendezvous::limits::kMaxIdBytes + 1, 'r');
  CHECK(error_of(long_id + " t\n") == "tokens.txt line 1: a run id or token is longer than 256 bytes");
  CHECK(error_of("r " + long_id + "\n") ==
        "tokens.txt line 1: a run id or token is longer than 256 bytes");
  // At the limit of ids and tokens: accepted.
  const std::string at(muster::rendezvous::limits::kMaxIdBytes, 'r');
  CHECK(parse_token_file(at + " " + at, "f").ok());
}

TEST_CASE("token file: the count and size bounds", "[credentials]") {
  std::string text;
  for (std::size_t i = 0; i < muster::rendezvous::kMaxTokenFileRuns; ++i) {
    text += "r" + std::to_string(i) + " t\n";
  }
  auto full = parse_token_file(text, "big");
  REQUIRE(full.ok());
  CHECK(full->size() == muster::rendezvous::kMaxTokenFileRuns);
  text += "one-more t\n";
  CHECK(error_of(text) == "tokens.txt line 100001: more than 100000 runs");
  const std::string huge(muster::rendezvous::kMaxTokenFileBytes + 1, '#');
  CHECK(error_of(huge) == "tokens.txt: larger than 16 MiB");
}

TEST_CASE("token file: reading one", "[credentials]") {
  muster::testing::TempDir dir;
  std::ofstream(dir.file("t")) << "a x\n";
  auto r = load_token_file(dir.file("t"));
  REQUIRE(r.ok());
  CHECK(r->at("a") == "x");
  auto missing = load_token_file(dir.file("none"));
  REQUIRE_FALSE(missing.ok());
  CHECK(std::string(missing.status().message()) ==
        dir.file("none") + ": cannot read it (No such file or directory)");
}

TEST_CASE("credentials: a listed run needs its own token, others the shared one", "[credentials]") {
  Credentials c("shared", RunTokens{{"a", "token-a"}, {"b", "token-b"}});
  CHECK(c.allows("a", "token-a"));
  CHECK_FALSE(c.allows("a", "token-b"));  // run b's token on run a
  CHECK_FALSE(c.allows("b", "token-a"));
  CHECK_FALSE(c.allows("a", "shared"));   // the shared token does not open a listed run
  CHECK_FALSE(c.allows("a", ""));
  CHECK_FALSE(c.allows("a", "token-a-and-more"));
  CHECK_FALSE(c.allows("a", "token-"));
  CHECK(c.allows("c", "shared"));         // unlisted: the shared token
  CHECK_FALSE(c.allows("c", "token-a"));
  CHECK(c.allows_all_runs("shared"));
  CHECK_FALSE(c.allows_all_runs("token-a"));
  CHECK(c.listed_runs() == 2);
}

TEST_CASE("credentials: a table without a shared token refuses unlisted runs", "[credentials]") {
  Credentials c("", RunTokens{{"a", "token-a"}});
  CHECK(c.allows("a", "token-a"));
  CHECK_FALSE(c.allows("c", ""));
  CHECK_FALSE(c.allows("c", "anything"));
  CHECK_FALSE(c.allows_all_runs(""));
  Credentials empty_table("", RunTokens{});
  CHECK_FALSE(empty_table.allows("a", ""));
  CHECK_FALSE(empty_table.allows_all_runs(""));
}

TEST_CASE("credentials: without a table, the shared token or an open server", "[credentials]") {
  Credentials shared("s");
  CHECK(shared.allows("any", "s"));
  CHECK_FALSE(shared.allows("any", "t"));
  CHECK(shared.allows_all_runs("s"));
  CHECK_FALSE(shared.allows_all_runs(""));
  Credentials open("");
  CHECK(open.allows("any", ""));
  CHECK(open.allows("any", "whatever"));
  CHECK(open.allows_all_runs(""));
  CHECK(open.listed_runs() == 0);
}

TEST_CASE("credentials: a reload replaces the table for every later check", "[credentials]") {
  Credentials c("", RunTokens{{"a", "token-a"}});
  CHECK_FALSE(c.allows("b", "token-b"));
  c.set_run_tokens(RunTokens{{"b", "token-b"}});
  CHECK(c.allows("b", "token-b"));
  CHECK_FALSE(c.allows("a", "token-a"));  // gone from the new file
  CHECK(c.listed_runs() == 1);
}

TEST_CASE("store core: a request's token must be its run's", "[credentials][store]") {
  using muster::rendezvous::StoreClock;
  using muster::rendezvous::StoreCore;
  using muster::v1::StoreReply;
  using muster::v1::StoreRequest;
  auto creds = std::make_shared<Credentials>("", RunTokens{{"a", "token-a"}, {"b", "token-b"}});
  StoreCore core(StoreCore::Options{{}, creds, true});
  core.open_run("a");
  core.open_run("b");
  std::vector<muster::rendezvous::StoreWaitPtr> woken;
  auto request = [&](const std::string& run, const std::string& token, StoreRequest::Op op) {
    struct Call : muster::rendezvous::StoreWait {
      StoreRequest req;
      StoreReply rep;
      Call() : StoreWait(&req, &rep) {}
    };
    auto c = std::make_shared<Call>();
    c->req.set_run_id(run);
    c->req.set_token(token);
    c->req.set_op(op);
    c->req.add_keys("k");
    if (op == StoreRequest::SET) c->req.add_values("v");
    auto st = core.handle(c, StoreClock::now(), woken);
    REQUIRE(st.has_value());
    return *st;
  };
  CHECK(request("a", "token-a", StoreRequest::SET).ok());
  // Run a's token on run b's table, for a read and a write: refused, and b's table unchanged.
  const absl::Status read = request("b", "token-a", StoreRequest::CHECK);
  CHECK(read.code() == absl::StatusCode::kPermissionDenied);
  CHECK(std::string(read.message()) == "store refused the call: wrong or missing token for this run");
  CHECK(request("b", "token-a", StoreRequest::SET).code() == absl::StatusCode::kPermissionDenied);
  CHECK(core.stats("b")->keys == 0);
  CHECK(request("b", "token-b", StoreRequest::SET).ok());
  CHECK(core.stats("b")->keys == 1);
  // An unlisted run, with no shared token: refused before the run is even looked up.
  CHECK(request("c", "token-a", StoreRequest::SET).code() == absl::StatusCode::kPermissionDenied);
}
