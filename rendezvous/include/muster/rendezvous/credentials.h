// Who may act on which run (docs/operations.md, "Per-run credentials"): the server's one
// answer for a Join, a store request and a status call.
//
// - A run listed in the token table needs its own token; the shared token does not open it.
// - A run not listed needs the shared token; with a table and no shared token it is refused.
// - Status of every run at once needs the shared token (again refused with a table and no
//   shared token).
// - With neither (no table, no shared token) the server is open.
// Every comparison of a presented token takes time that depends only on its length
// (token_matches, text.h).
//
// Thread safety: every method may be called from any thread; set_run_tokens (a reload)
// replaces the table at once for every later check, while a check in flight finishes with
// the table it started with.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace muster::rendezvous {

// run id -> its token.
using RunTokens = std::unordered_map<std::string, std::string>;

// Bounds of a token file (rdzvd --token_file): its size, its runs; each run id and token is
// at most limits::kMaxIdBytes.
inline constexpr std::size_t kMaxTokenFileBytes = 16 << 20;
inline constexpr std::size_t kMaxTokenFileRuns = 100000;

// A token file's text: one `RUN_ID TOKEN` per line (blanks between and around them), blank
// lines, and comments (a line whose first non-blank character is '#', or a '#' word after the
// token, to the line's end). Run ids and tokens are UTF-8 without blanks; a run listed twice
// is an error. Errors say "<file> line N: ...". `file` only names it in messages.
absl::StatusOr<RunTokens> parse_token_file(absl::string_view text, absl::string_view file);
// Reads `path` (at most kMaxTokenFileBytes) and parses it.
absl::StatusOr<RunTokens> load_token_file(const std::string& path);

class Credentials {
 public:
  // `shared`: the shared token ("" for none). `runs`: the per-run table, when there is one
  // (an empty table still refuses unlisted runs without a shared token).
  explicit Credentials(std::string shared, std::optional<RunTokens> runs = std::nullopt);

  // Join, store calls and the status of one run.
  bool allows(std::string_view run_id, std::string_view token) const;
  // The status of every run.
  bool allows_all_runs(std::string_view token) const;

  // Replaces the per-run table (a reload).
  void set_run_tokens(RunTokens runs);
  // Runs listed now (0 without a table).
  std::size_t listed_runs() const;

 private:
  const std::string shared_;
  mutable absl::Mutex mu_;
  // Null: no table. Replaced whole, so a check holds the one it read.
  std::shared_ptr<const RunTokens> runs_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const RunTokens> table() const;
};

}  // namespace muster::rendezvous
