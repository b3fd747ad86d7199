#include "muster/rendezvous/credentials.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "muster/rendezvous/limits.h"
#include "muster/ops/text.h"

namespace muster::rendezvous {

absl::StatusOr<RunTokens> parse_token_file(absl::string_view text, absl::string_view file) {
  if (text.size() > kMaxTokenFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": larger than ", kMaxTokenFileBytes >> 20, " MiB"));
  }
  RunTokens runs;
  std::unordered_map<std::string, std::size_t> line_of;  // for "listed twice"
  std::size_t n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++n;
    auto fail = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(file, " line ", n, ": ", what));
    };
    std::vector<absl::string_view> words = absl::StrSplit(line, absl::ByAnyChar(" \t\r\f\v"),
                                                         absl::SkipEmpty());
    if (words.empty() || words[0][0] == '#') continue;
    if (words.size() < 2 || words[1][0] == '#') return fail("expected 'RUN_ID TOKEN', got a run id alone");
    if (words.size() > 2 && words[2][0] != '#') {
      return fail("expected 'RUN_ID TOKEN' (a comment after them starts with '#')");
    }
    const absl::string_view run = words[0], token = words[1];
    if (run.size() > limits::kMaxIdBytes || token.size() > limits::kMaxIdBytes) {
      return fail(absl::StrCat("a run id or token is longer than ", limits::kMaxIdBytes, " bytes"));
    }
    if (!ops::is_valid_utf8(std::string_view(run.data(), run.size())) ||
        !ops::is_valid_utf8(std::string_view(token.data(), token.size()))) {
      return fail("not valid UTF-8");
    }
    if (auto [it, fresh] = line_of.emplace(std::string(run), n); !fresh) {
      return fail(absl::StrCat("run '", run, "' is already listed on line ", it->second));
    }
    if (runs.size() == kMaxTokenFileRuns) {
      return fail(absl::StrCat("more than ", kMaxTokenFileRuns, " runs"));
    }
    runs.emplace(std::string(run), std::string(token));
  }
  return runs;
}

absl::StatusOr<RunTokens> load_token_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": cannot read it (", std::strerror(errno), ")"));
  }
  std::string text(kMaxTokenFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read it"));
  text.resize(static_cast<std::size_t>(in.gcount()));
  return parse_token_file(text, path);
}

Credentials::Credentials(std::string shared, std::optional<RunTokens> runs)
    : shared_(std::move(shared)) {
  if (runs) runs_ = std::make_shared<const RunTokens>(std::move(*runs));
}

std::shared_ptr<const RunTokens> Credentials::table() const {
  absl::ReaderMutexLock lock(&mu_);
  return runs_;
}

bool Credentials::allows(std::string_view run_id, std::string_view token) const {
  const std::shared_ptr<const RunTokens> runs = table();
  if (runs) {
    // Run ids are not secret: finding one takes what it takes; its token is compared in
    // constant time (never empty: the parser has no empty words).
    auto it = runs->find(std::string(run_id));
    if (it != runs->end()) return ops::token_matches(token, it->second);
    if (shared_.empty()) return false;
  }
  return ops::token_matches(token, shared_);
}

bool Credentials::allows_all_runs(std::string_view token) const {
  if (shared_.empty()) return table() == nullptr;
  return ops::token_matches(token, shared_);
}

void Credentials::set_run_tokens(RunTokens runs) {
  auto fresh = std::make_shared<const RunTokens>(std::move(runs));
  std::shared_ptr<const RunTokens> old;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  old = std::move(runs_);
  runs_ = std::move(fresh);
}

std::size_t Credentials::listed_runs() const {
  const std::shared_ptr<const RunTokens> runs = table();
  return runs ? runs->size() : 0;
}

}  // namespace muster::rendezvous
