// Checks and repairs of untrusted text, shared by the rendezvous server, the store and the
// agent: ids must be UTF-8 (INVALID_ARGUMENT otherwise), text meant for people is repaired.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace muster::ops {

// The length of the well-formed UTF-8 sequence at s[i] (i < s.size()), or 0 if there is none
// (a stray continuation byte, an overlong form, a surrogate, beyond U+10FFFF, cut short).
std::size_t utf8_sequence_length(std::string_view s, std::size_t i);

bool is_valid_utf8(std::string_view s);

// `s` as valid UTF-8 for people to read: each bad byte becomes U+FFFD; with
// `replace_controls`, so do control characters other than tab and newline (they could drive a
// terminal). At most `max` bytes of `s` are used; "..." marks that more followed.
std::string printable_utf8(std::string_view s, std::size_t max = std::string_view::npos,
                           bool replace_controls = false);

// Whether a presented credential matches the expected one; with no expected credential (an
// open server) anything matches. The time taken depends only on the lengths, so a client
// cannot learn a token byte by byte from response times.
bool token_matches(std::string_view given, std::string_view expected);

}  // namespace muster::ops
