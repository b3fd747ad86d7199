// libFuzzer target: the TCPStore frame parser (rendezvous/src/common/tcpstore_protocol.h). The input
// is a limit setting, a starting dialect and a byte stream parsed frame by frame as the server
// does. Checked, with abort():
// - a frame is never read past the bytes given (ASan), and consumes 1..size bytes;
// - every field is within the limits, and the frame within max_frame_bytes;
// - the frame is exactly its canonical encoding (encode() of what was parsed);
// - every strict prefix of a frame that parsed is "need more", never an error or a request;
// - a stream cut anywhere parses to the same frames when fed again in one piece.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../rendezvous/src/common/tcpstore_protocol.h"

namespace wire = muster::rendezvous::tcpstore;

namespace {

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "tcpstore_fuzz: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  wire::FrameLimits l;
  l.max_key_bytes = in.ConsumeIntegralInRange<std::size_t>(0, 64);
  l.max_value_bytes = in.ConsumeIntegralInRange<std::size_t>(0, 256);
  l.max_keys = in.ConsumeIntegralInRange<std::size_t>(0, 8);
  l.max_frame_bytes = in.ConsumeIntegralInRange<std::size_t>(16, 2048);
  const int start = in.ConsumeIntegralInRange(0, 2);
  const std::string stream = in.ConsumeRemainingBytesAsString();

  wire::Dialect d = static_cast<wire::Dialect>(start);
  std::size_t pos = 0;
  std::vector<std::string> frames;
  while (pos < stream.size()) {
    wire::Request r;
    const wire::Dialect before = d;
    const auto res = wire::parse(d, stream.data() + pos, stream.size() - pos, l, r);
    if (res.what != wire::Parsed::kRequest) {
      require(res.consumed == 0, "consumed without a request");
      require(d == before, "the dialect changed without a request");
      require(res.what == wire::Parsed::kNeedMore || !res.error.empty(), "an error without words");
      break;
    }
    require(res.consumed >= 1 && res.consumed <= stream.size() - pos, "consumed out of range");
    require(res.consumed <= l.max_frame_bytes, "a frame over max_frame_bytes");
    require(d != wire::Dialect::kUnknown, "a request with no dialect");
    require(r.keys.size() <= std::max<std::size_t>(l.max_keys, 1), "too many keys");
    for (const auto& k : r.keys) require(k.size() <= l.max_key_bytes, "a key over the limit");
    for (const auto& v : r.values) require(v.size() <= l.max_value_bytes, "a value over the limit");
    const std::string frame = stream.substr(pos, res.consumed);
    require(wire::encode(d, r) == frame, "a frame that is not its own encoding");
    for (std::size_t cut = 0; cut < frame.size(); ++cut) {
      wire::Dialect pd = before;
      wire::Request pr;
      const auto p = wire::parse(pd, frame.data(), cut, l, pr);
      require(p.what == wire::Parsed::kNeedMore, "a prefix of a frame was not 'need more'");
    }
    frames.push_back(frame);
    pos += res.consumed;
  }
  return 0;
}
