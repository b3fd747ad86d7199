// Turns a worker's raw output into whole, prefixed lines.
//
// feed() returns the complete lines seen so far, each prefixed; a partial line is held
// until its newline arrives. finish() (at end of stream) returns the held partial line with
// a newline added, so a worker that dies mid-line still shows what it wrote. A line longer
// than max_line is emitted in max_line pieces, each prefixed, to bound memory.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace muster::agent {

class LineSplitter {
 public:
  explicit LineSplitter(std::string prefix, std::size_t max_line = 1 << 20)
      : prefix_(std::move(prefix)), max_line_(max_line) {}

  // Appends the prefixed complete lines found in `chunk` to `out`.
  void feed(std::string_view chunk, std::string& out);
  // Appends the held partial line, if any, to `out` (prefixed, newline added).
  void finish(std::string& out);

  const std::string& prefix() const { return prefix_; }
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }

 private:
  std::string prefix_;
  std::size_t max_line_;
  std::string partial_;
};

// Expands torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: $role_name / ${role_name},
// $rank / ${rank}, $local_rank / ${local_rank}, "$$" for "$"; other text is kept as is
// (Python's Template.safe_substitute).
std::string expand_prefix_template(std::string_view tmpl, const std::string& role_name, int rank,
                                   int local_rank);

// Writes all of `data` to `fd` (a console or a log file), retrying short writes and EINTR;
// gives up quietly when the reader is gone (EPIPE).
void write_all(int fd, std::string_view data);

// The prefix used when the template is unset: "[<role><rank>]:" as torchrun's tee shows it.
inline constexpr std::string_view kDefaultPrefixTemplate = "[${role_name}${rank}]:";

}  // namespace muster::agent
