// RunStore on files: one per run, written atomically (temporary file + rename). See
// run_store.h for the layout and the fsync policy.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/run_store.h"
#include "muster/ops/text.h"

namespace muster::rendezvous {
namespace {

constexpr char kMagic[8] = {'M', 'U', 'S', 'T', 'R', 'U', 'N', '1'};
constexpr std::size_t kHeaderBytes = 8 + 8 + 8;  // magic, payload length, FNV-1a of the payload
const std::string kPrefix = "run-";
const std::string kSuffix = ".rec";
const std::string kTmpSuffix = ".tmp";

// FNV-1a, 64 bits: stable across processes and builds (file names, checksums).
std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string file_name(const std::string& run_id) {
  return absl::StrFormat("%s%016x%s", kPrefix, fnv1a(run_id), kSuffix);
}

void put_u64(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
std::uint64_t get_u64(const char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

std::string errno_text() { return std::strerror(errno); }

class FileRunStore final : public RunStore {
 public:
  FileRunStore(FileRunStoreOptions opts, int dir_fd, int lock_fd)
      : opts_(std::move(opts)), dir_fd_(dir_fd), lock_fd_(lock_fd) {}
  ~FileRunStore() override {
    ::close(lock_fd_);  // releases the lock
    ::close(dir_fd_);
  }

  absl::StatusOr<Loaded> load_all() override {
    Loaded loaded;
    const int fd = ::dup(dir_fd_);
    if (fd < 0) return absl::InternalError(absl::StrCat("state folder ", opts_.dir, ": ", errno_text()));
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      ::close(fd);
      return absl::InternalError(absl::StrCat("state folder ", opts_.dir, ": ", errno_text()));
    }
    ::rewinddir(d);
    std::vector<std::string> names;
    while (dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
    ::closedir(d);
    std::sort(names.begin(), names.end());
    for (const std::string& name : names) {
      if (!absl::StartsWith(name, kPrefix)) continue;
      if (absl::EndsWith(name, kTmpSuffix)) {
        ::unlinkat(dir_fd_, name.c_str(), 0);  // a write that never got to its rename
        continue;
      }
      if (!absl::EndsWith(name, kSuffix)) continue;
      if (loaded.records.size() >= limits::kMaxRuns) {
        loaded.skipped.push_back(absl::StrCat(name, ": more than ", limits::kMaxRuns,
                                              " runs; not loaded"));
        continue;
      }
      absl::StatusOr<v1::RunRecord> r = read_one(name);
      if (!r.ok()) {
        const std::string aside = name + ".corrupt";
        ::renameat(dir_fd_, name.c_str(), dir_fd_, aside.c_str());
        loaded.skipped.push_back(absl::StrCat(name, ": ", r.status().message(), " (moved to ",
                                              aside, ")"));
        continue;
      }
      loaded.records.push_back(std::move(*r));
    }
    std::sort(loaded.records.begin(), loaded.records.end(),
              [](const v1::RunRecord& a, const v1::RunRecord& b) { return a.run_id() < b.run_id(); });
    return loaded;
  }

  absl::Status put(const v1::RunRecord& record) override {
    std::string payload;
    if (!record.SerializeToString(&payload)) return absl::InternalError("cannot serialize a record");
    const std::string run = ops::printable_utf8(record.run_id(), limits::kMaxIdBytes);
    if (payload.size() > limits::kMaxRunRecordBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the record of run '", run, "' is ", payload.size(),
                       " bytes, more than the limit of ", limits::kMaxRunRecordBytes));
    }
    std::string bytes(kMagic, sizeof kMagic);
    put_u64(bytes, payload.size());
    put_u64(bytes, fnv1a(payload));
    bytes += payload;
    const std::string name = file_name(record.run_id());
    const std::string tmp = absl::StrCat(name, kTmpSuffix);
    auto failed = [&](const char* what) {
      const absl::Status st = absl::UnavailableError(absl::StrCat(
          "cannot ", what, " ", opts_.dir, "/", tmp, " (run '", run, "'): ", errno_text()));
      ::unlinkat(dir_fd_, tmp.c_str(), 0);
      return st;
    };
    const int fd = ::openat(dir_fd_, tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return failed("create");
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        ::close(fd);
        return failed("write");
      }
      done += static_cast<std::size_t>(n);
    }
    if (opts_.fsync && ::fsync(fd) != 0) {
      ::close(fd);
      return failed("flush");
    }
    if (::close(fd) != 0) return failed("close");
    if (::renameat(dir_fd_, tmp.c_str(), dir_fd_, name.c_str()) != 0) return failed("rename");
    if (opts_.fsync && ::fsync(dir_fd_) != 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot flush the state folder ", opts_.dir, ": ", errno_text()));
    }
    return absl::OkStatus();
  }

  absl::Status erase(const std::string& run_id) override {
    const std::string name = file_name(run_id);
    if (::unlinkat(dir_fd_, name.c_str(), 0) != 0 && errno != ENOENT) {
      return absl::UnavailableError(
          absl::StrCat("cannot remove ", opts_.dir, "/", name, ": ", errno_text()));
    }
    if (opts_.fsync) ::fsync(dir_fd_);
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<v1::RunRecord> read_one(const std::string& name) {
    const int fd = ::openat(dir_fd_, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return absl::DataLossError(absl::StrCat("cannot open: ", errno_text()));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::DataLossError("not a regular file");
    }
    const auto size = static_cast<std::size_t>(st.st_size);
    if (size < kHeaderBytes || size - kHeaderBytes > limits::kMaxRunRecordBytes) {
      ::close(fd);
      return absl::DataLossError(absl::StrCat("size ", size, " is not that of a record (at most ",
                                              limits::kMaxRunRecordBytes, " bytes after a ",
                                              kHeaderBytes, "-byte header)"));
    }
    std::string bytes(size, '\0');
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::read(fd, bytes.data() + done, size - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<std::size_t>(n);
    }
    ::close(fd);
    if (done != size) return absl::DataLossError("cannot read it whole");
    if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
      return absl::DataLossError("not a run record (bad magic)");
    }
    const std::uint64_t length = get_u64(bytes.data() + 8);
    const std::uint64_t sum = get_u64(bytes.data() + 16);
    const std::string_view payload(bytes.data() + kHeaderBytes, size - kHeaderBytes);
    if (length != payload.size() || fnv1a(payload) != sum) {
      return absl::DataLossError("length or checksum does not match");
    }
    v1::RunRecord r;
    if (!r.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return absl::DataLossError("the record does not parse");
    }
    if (file_name(r.run_id()) != name) {
      return absl::DataLossError("it holds the record of another run");
    }
    return r;
  }

  FileRunStoreOptions opts_;
  int dir_fd_;
  int lock_fd_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RunStore>> open_file_run_store(const FileRunStoreOptions& options) {
  const std::string& dir = options.dir;
  if (dir.empty()) return absl::InvalidArgumentError("state folder: empty path");
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat("state folder ", dir, ": ", errno_text()));
  }
  if (::faccessat(dir_fd, ".", W_OK | X_OK, AT_EACCESS) != 0) {
    const std::string why = errno_text();
    ::close(dir_fd);
    return absl::InvalidArgumentError(absl::StrCat("state folder ", dir, " is not writable: ", why));
  }
  const int lock_fd = ::openat(dir_fd, "lock", O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0) {
    const std::string why = errno_text();
    ::close(dir_fd);
    return absl::InvalidArgumentError(
        absl::StrCat("state folder ", dir, ": cannot create its lock file: ", why));
  }
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const bool busy = errno == EWOULDBLOCK;
    const std::string why = errno_text();
    ::close(lock_fd);
    ::close(dir_fd);
    return absl::FailedPreconditionError(
        busy ? absl::StrCat("state folder ", dir, " is in use by another server (it holds ", dir,
                            "/lock)")
             : absl::StrCat("state folder ", dir, ": cannot lock it: ", why));
  }
  return std::unique_ptr<RunStore>(new FileRunStore(options, dir_fd, lock_fd));
}

}  // namespace muster::rendezvous
