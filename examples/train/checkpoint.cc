#include "checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace muster::train {
namespace {

constexpr char kMagic[8] = {'M', 'U', 'S', 'T', 'E', 'R', 'C', 'K'};
constexpr std::uint32_t kVersion = 1;

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

template <typename T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void put_floats(std::string& out, const std::vector<float>& v) {
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  template <typename T>
  bool get(T& v) {
    if (s_.size() - pos_ < sizeof v) return false;
    std::memcpy(&v, s_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return true;
  }
  bool get_bytes(std::size_t n, char* dst) {
    if (s_.size() - pos_ < n) return false;
    std::memcpy(dst, s_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  std::size_t pos() const { return pos_; }

 private:
  const std::string& s_;
  std::size_t pos_ = 0;
};

absl::Status errno_error(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::Status save_checkpoint(const std::string& dir, const Checkpoint& c) {
  std::string out(kMagic, sizeof kMagic);
  put(out, kVersion);
  put(out, static_cast<std::uint64_t>(c.fingerprint.size()));
  out += c.fingerprint;
  put(out, c.step);
  put(out, c.adam_steps);
  put(out, c.scale);
  put(out, c.growth_tracker);
  put(out, static_cast<std::uint64_t>(c.params.size()));
  put_floats(out, c.params);
  put_floats(out, c.m);
  put_floats(out, c.v);
  put(out, fnv1a(out));

  const std::string tmp = absl::StrCat(dir, "/.checkpoint.bin.", ::getpid());
  const std::string final_path = dir + "/checkpoint.bin";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno_error("checkpoint: cannot create " + tmp);
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::write(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status st = errno_error("checkpoint: cannot write " + tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return st;
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    absl::Status st = errno_error("checkpoint: cannot sync " + tmp);
    ::unlink(tmp.c_str());
    return st;
  }
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    absl::Status st = errno_error("checkpoint: cannot rename to " + final_path);
    ::unlink(tmp.c_str());
    return st;
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<Checkpoint> load_checkpoint(const std::string& dir) {
  const std::string path = dir + "/checkpoint.bin";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no checkpoint at ", path));
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto damaged = [&](const char* why) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is damaged: ", why));
  };
  if (s.size() < sizeof kMagic + sizeof(std::uint64_t) || std::memcmp(s.data(), kMagic, sizeof kMagic) != 0) {
    return damaged("not a checkpoint file");
  }
  std::uint64_t sum;
  std::memcpy(&sum, s.data() + s.size() - sizeof sum, sizeof sum);
  if (fnv1a(s.substr(0, s.size() - sizeof sum)) != sum) return damaged("checksum mismatch");
  Reader r(s);
  char magic[sizeof kMagic];
  std::uint32_t version = 0;
  std::uint64_t flen = 0, n = 0;
  Checkpoint c;
  r.get_bytes(sizeof magic, magic);
  if (!r.get(version) || version != kVersion) return damaged("unknown version");
  if (!r.get(flen) || flen > s.size()) return damaged("truncated");
  c.fingerprint.resize(flen);
  if (!r.get_bytes(flen, c.fingerprint.data())) return damaged("truncated");
  if (!r.get(c.step) || !r.get(c.adam_steps) || !r.get(c.scale) || !r.get(c.growth_tracker) ||
      !r.get(n) || n > s.size() / sizeof(float)) {
    return damaged("truncated");
  }
  for (std::vector<float>* v : {&c.params, &c.m, &c.v}) {
    v->resize(n);
    if (!r.get_bytes(n * sizeof(float), reinterpret_cast<char*>(v->data()))) return damaged("truncated");
  }
  if (r.pos() + sizeof sum != s.size()) return damaged("trailing bytes");
  return c;
}

}  // namespace muster::train
