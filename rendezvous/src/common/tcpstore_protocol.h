// c10d's TCPStore wire protocol, as torch's own client speaks it: the parsing and encoding
// half, pure (no sockets, no clock), so that the frame parser can be fuzzed and unit tested.
//
// A frame is one query byte and its arguments; every integer is in the host's byte order
// (torch sends raw native values), a string is a uint64 length and its bytes, a key list is a
// uint64 count and that many strings. Two dialects, told apart by a connection's first bytes:
// - torch 1.13 (Debian's python3-torch): SET 0, COMPARE_SET 1, GET 2, ADD 3, CHECK 4, WAIT 5,
//   GETNUMKEYS 6, WATCH_KEY 7, DELETE_KEY 8, APPEND 9, MULTI_GET 10, MULTI_SET 11,
//   CANCEL_WAIT 12. No handshake.
// - torch 2.x (main's libuv server): VALIDATE 0 with the uint32 0x3C85F7CE first, then SET 1,
//   COMPARE_SET 2, GET 3, ADD 4, CHECK 5, WAIT 6, GETNUMKEYS 7, DELETE_KEY 8, APPEND 9,
//   MULTI_GET 10, MULTI_SET 11, CANCEL_WAIT 12, PING 13, QUEUE_PUSH 14, QUEUE_POP 15,
//   QUEUE_LEN 16.
// (PING's place after CANCEL_WAIT is read from torch's TCPStoreBackend.hpp; the queue ops'
// numbers, after PING, from the libuv server's dispatch: no 2.x client runs here to check them.
// One classic-server commit of torch's reads a uint32 magic before every query; main's default
// libuv server, which this follows, does not.)
// A first byte 0 followed by the magic is the 2.x handshake; anything else is 1.13 (a 1.13
// SET whose key length starts with the magic would be a key of about 1 GB, over every limit).
//
// Limits are checked as soon as a length arrives: a frame that says it is longer than the
// limits allow is refused before its bytes are awaited (a length that lies costs nothing).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace muster::rendezvous::tcpstore {

inline constexpr std::uint32_t kValidationMagic = 0x3C85F7CE;

enum class Dialect { kUnknown, kTorch1, kTorch2 };

enum class Op {
  kValidate,
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kNumKeys,
  kWatchKey,
  kDelete,
  kAppend,
  kMultiGet,
  kMultiSet,
  kCancelWait,
  kPing,
  kQueuePush,
  kQueuePop,
  kQueueLen,
};
const char* op_name(Op op);

// The wire byte of `op` in dialect `d` (kUnknown counts as kTorch1), or -1 where `d` has no
// such query (WATCH_KEY in 2.x; VALIDATE, PING and the queue ops in 1.13).
int wire_byte(Dialect d, Op op);

// Whether the server answers `op` (WAIT: once its keys are there); SET, APPEND, MULTI_SET,
// QUEUE_PUSH and VALIDATE have no reply.
bool answers(Op op);

// Reply bytes the protocol defines.
inline constexpr std::uint8_t kCheckReady = 0, kCheckNotReady = 1;
inline constexpr std::uint8_t kStopWaiting = 0, kWaitCanceled = 1;
inline constexpr std::uint8_t kWatchUpdated = 0, kWatchCreated = 1, kWatchDeleted = 2,
                              kWatchRegistered = 3, kWatchAppended = 4;

struct Request {
  Op op = Op::kSet;
  std::vector<std::string> keys;    // one for the single-key queries
  std::vector<std::string> values;  // SET/APPEND/QUEUE_PUSH: 1; COMPARE_SET: expected, desired;
                                    // MULTI_SET: one per key
  std::int64_t delta = 0;           // ADD
  std::uint32_t number = 0;         // VALIDATE's magic, PING's nonce
};

struct FrameLimits {
  std::size_t max_key_bytes = 0;
  std::size_t max_value_bytes = 0;
  std::size_t max_keys = 0;         // keys of one CHECK, WAIT, MULTI_GET or MULTI_SET
  std::size_t max_frame_bytes = 0;  // one frame, all its fields
};

enum class Parsed { kNeedMore, kRequest, kError };

struct ParseResult {
  Parsed what = Parsed::kNeedMore;
  std::size_t consumed = 0;  // bytes of the frame (kRequest)
  std::string error;         // kError: what was wrong, for the log line
};

// Parses the first frame of data[0, size). `dialect` is the connection's: kUnknown until its
// first frame decides it (parse sets it then). Nothing is consumed unless kRequest.
ParseResult parse(Dialect& dialect, const char* data, std::size_t size, const FrameLimits& limits,
                  Request& out);

// Reply encoding, appended to `out` in the host's byte order.
void put_u8(std::string& out, std::uint8_t v);
void put_u32(std::string& out, std::uint32_t v);
void put_i64(std::string& out, std::int64_t v);
void put_bytes(std::string& out, const std::string& v);  // uint64 length, then the bytes

// A whole frame of `req` in `dialect` (for clients: tests, benchmarks). Empty where the
// dialect has no such query.
std::string encode(Dialect dialect, const Request& req);

}  // namespace muster::rendezvous::tcpstore
