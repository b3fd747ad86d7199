#include "common/tcpstore_protocol.h"

#include <cstring>

namespace muster::rendezvous::tcpstore {
namespace {

// The query bytes of each dialect, in wire order.
constexpr Op kTorch1Ops[] = {Op::kSet,     Op::kCompareSet, Op::kGet,      Op::kAdd,
                             Op::kCheck,   Op::kWait,       Op::kNumKeys,  Op::kWatchKey,
                             Op::kDelete,  Op::kAppend,     Op::kMultiGet, Op::kMultiSet,
                             Op::kCancelWait};
constexpr Op kTorch2Ops[] = {Op::kValidate,  Op::kSet,      Op::kCompareSet, Op::kGet,
                             Op::kAdd,       Op::kCheck,    Op::kWait,       Op::kNumKeys,
                             Op::kDelete,    Op::kAppend,   Op::kMultiGet,   Op::kMultiSet,
                             Op::kCancelWait, Op::kPing,    Op::kQueuePush,  Op::kQueuePop,
                             Op::kQueueLen};

// Reads the fields after a frame's query byte (so `max_frame` is the frame's limit less one);
// every read checks the frame limit first, then the bytes at hand.
class Cursor {
 public:
  Cursor(const char* data, std::size_t size, std::size_t max_frame)
      : data_(data), size_(size), max_(max_frame) {}

  // False with need_more() or error() set when the field cannot be read (yet).
  template <class T>
  bool value(T& v) {
    if (!have(sizeof(T))) return false;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool string(std::string& s, std::size_t max_len, const char* what) {
    std::uint64_t len = 0;
    if (!value(len)) return false;
    if (len > max_len) {
      error_ = std::string(what) + " of " + std::to_string(len) + " bytes (the limit is " +
               std::to_string(max_len) + ")";
      return false;
    }
    if (!have(static_cast<std::size_t>(len))) return false;
    s.assign(data_ + pos_, static_cast<std::size_t>(len));
    pos_ += static_cast<std::size_t>(len);
    return true;
  }
  bool count(std::uint64_t& n, std::size_t max_n) {
    if (!value(n)) return false;
    if (n > max_n) {
      error_ = std::to_string(n) + " keys in one query (the limit is " + std::to_string(max_n) + ")";
      return false;
    }
    return true;
  }
  std::size_t pos() const { return pos_; }
  const std::string& error() const { return error_; }

 private:
  bool have(std::size_t n) {
    if (n > max_ - pos_) {
      error_ = "a frame over " + std::to_string(max_ + 1) + " bytes";  // its query byte too
      return false;
    }
    return n <= size_ - pos_;
  }

  const char* data_;
  std::size_t size_, max_, pos_ = 0;
  std::string error_;
};

bool has_key(Op op) {
  switch (op) {
    case Op::kSet:
    case Op::kCompareSet:
    case Op::kGet:
    case Op::kAdd:
    case Op::kWatchKey:
    case Op::kDelete:
    case Op::kAppend:
    case Op::kQueuePush:
    case Op::kQueuePop:
    case Op::kQueueLen:
      return true;
    default:
      return false;
  }
}

// The arguments of `op`, after its query byte.
bool fields(Cursor& c, Op op, const FrameLimits& l, Request& r) {
  r.keys.clear();
  r.values.clear();
  if (has_key(op)) {
    r.keys.emplace_back();
    if (!c.string(r.keys.back(), l.max_key_bytes, "a key")) return false;
  }
  switch (op) {
    case Op::kValidate:
    case Op::kPing:
      return c.value(r.number);
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush:
      r.values.emplace_back();
      return c.string(r.values.back(), l.max_value_bytes, "a value");
    case Op::kCompareSet:
      r.values.resize(2);
      return c.string(r.values[0], l.max_value_bytes, "a value") &&
             c.string(r.values[1], l.max_value_bytes, "a value");
    case Op::kAdd:
      return c.value(r.delta);
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
    case Op::kMultiSet: {
      std::uint64_t n = 0;
      if (!c.count(n, l.max_keys)) return false;
      for (std::uint64_t i = 0; i < n; ++i) {
        r.keys.emplace_back();
        if (!c.string(r.keys.back(), l.max_key_bytes, "a key")) return false;
        if (op == Op::kMultiSet) {
          r.values.emplace_back();
          if (!c.string(r.values.back(), l.max_value_bytes, "a value")) return false;
        }
      }
      return true;
    }
    default:  // GET, GETNUMKEYS, WATCH_KEY, DELETE_KEY, CANCEL_WAIT, QUEUE_POP, QUEUE_LEN
      return true;
  }
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kValidate: return "VALIDATE";
    case Op::kSet: return "SET";
    case Op::kCompareSet: return "COMPARE_SET";
    case Op::kGet: return "GET";
    case Op::kAdd: return "ADD";
    case Op::kCheck: return "CHECK";
    case Op::kWait: return "WAIT";
    case Op::kNumKeys: return "GETNUMKEYS";
    case Op::kWatchKey: return "WATCH_KEY";
    case Op::kDelete: return "DELETE_KEY";
    case Op::kAppend: return "APPEND";
    case Op::kMultiGet: return "MULTI_GET";
    case Op::kMultiSet: return "MULTI_SET";
    case Op::kCancelWait: return "CANCEL_WAIT";
    case Op::kPing: return "PING";
    case Op::kQueuePush: return "QUEUE_PUSH";
    case Op::kQueuePop: return "QUEUE_POP";
    case Op::kQueueLen: return "QUEUE_LEN";
  }
  return "?";
}

int wire_byte(Dialect d, Op op) {
  const Op* ops = d == Dialect::kTorch2 ? kTorch2Ops : kTorch1Ops;
  const std::size_t n = d == Dialect::kTorch2 ? std::size(kTorch2Ops) : std::size(kTorch1Ops);
  for (std::size_t i = 0; i < n; ++i) {
    if (ops[i] == op) return static_cast<int>(i);
  }
  return -1;
}

ParseResult parse(Dialect& dialect, const char* data, std::size_t size, const FrameLimits& limits,
                  Request& out) {
  ParseResult r;
  if (size == 0) return r;
  const auto byte = static_cast<std::uint8_t>(data[0]);
  Dialect d = dialect;
  if (d == Dialect::kUnknown) {
    if (byte != 0) {
      d = Dialect::kTorch1;
    } else {
      if (size < 1 + sizeof(std::uint32_t)) return r;
      std::uint32_t magic = 0;
      std::memcpy(&magic, data + 1, sizeof magic);
      d = magic == kValidationMagic ? Dialect::kTorch2 : Dialect::kTorch1;
    }
  }
  const Op* ops = d == Dialect::kTorch2 ? kTorch2Ops : kTorch1Ops;
  const std::size_t n = d == Dialect::kTorch2 ? std::size(kTorch2Ops) : std::size(kTorch1Ops);
  if (byte >= n) {
    r.what = Parsed::kError;
    r.error = "an unknown query type " + std::to_string(byte);
    return r;
  }
  Cursor c(data + 1, size - 1, limits.max_frame_bytes - 1);
  out.op = ops[byte];
  if (!fields(c, out.op, limits, out)) {
    if (!c.error().empty()) {
      r.what = Parsed::kError;
      r.error = std::string(op_name(out.op)) + ": " + c.error();
    }
    return r;
  }
  if (out.op == Op::kValidate && out.number != kValidationMagic) {
    r.what = Parsed::kError;
    r.error = "VALIDATE with a wrong magic number";
    return r;
  }
  dialect = d;
  r.what = Parsed::kRequest;
  r.consumed = 1 + c.pos();
  return r;
}

void put_u8(std::string& out, std::uint8_t v) { out.push_back(static_cast<char>(v)); }

void put_u32(std::string& out, std::uint32_t v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void put_i64(std::string& out, std::int64_t v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void put_bytes(std::string& out, const std::string& v) {
  const std::uint64_t len = v.size();
  out.append(reinterpret_cast<const char*>(&len), sizeof len);
  out.append(v);
}

bool answers(Op op) {
  switch (op) {
    case Op::kValidate:
    case Op::kSet:
    case Op::kAppend:
    case Op::kMultiSet:
    case Op::kQueuePush:
      return false;
    default:
      return true;
  }
}

std::string encode(Dialect dialect, const Request& req) {
  const int b = wire_byte(dialect, req.op);
  if (b < 0) return "";
  std::string out;
  put_u8(out, static_cast<std::uint8_t>(b));
  if (has_key(req.op)) put_bytes(out, req.keys.empty() ? std::string() : req.keys[0]);
  switch (req.op) {
    case Op::kValidate:
    case Op::kPing:
      put_u32(out, req.number);
      break;
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush:
      put_bytes(out, req.values.empty() ? std::string() : req.values[0]);
      break;
    case Op::kCompareSet:
      put_bytes(out, req.values.size() > 0 ? req.values[0] : std::string());
      put_bytes(out, req.values.size() > 1 ? req.values[1] : std::string());
      break;
    case Op::kAdd:
      put_i64(out, req.delta);
      break;
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
    case Op::kMultiSet: {
      const std::uint64_t n = req.keys.size();
      out.append(reinterpret_cast<const char*>(&n), sizeof n);
      for (std::size_t i = 0; i < req.keys.size(); ++i) {
        put_bytes(out, req.keys[i]);
        if (req.op == Op::kMultiSet) put_bytes(out, i < req.values.size() ? req.values[i] : "");
      }
      break;
    }
    default:
      break;
  }
  return out;
}

}  // namespace muster::rendezvous::tcpstore
