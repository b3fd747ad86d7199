#include "muster/worker/progress.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

namespace muster::worker {
namespace {

// Warns (once per reporter; a worker makes one) and gives no page: a worker that cannot report
// progress still trains.
ProgressPage* unusable(const std::string& path, const std::string& why) {
  std::fprintf(stderr, "muster: progress reports off: %s %s: %s\n", kProgressFileVar,
               path.c_str(), why.c_str());
  return nullptr;
}

ProgressPage* map_page(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return unusable(path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return unusable(path, std::strerror(err));
  }
  if (st.st_size < static_cast<off_t>(kProgressPageBytes)) {
    ::close(fd);
    return unusable(path, "shorter than a progress page (" + std::to_string(st.st_size) + " bytes)");
  }
  void* m = ::mmap(nullptr, kProgressPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file
  if (m == MAP_FAILED) return unusable(path, std::strerror(err));
  auto* page = static_cast<ProgressPage*>(m);
  if (__atomic_load_n(&page->magic, __ATOMIC_RELAXED) != kProgressMagic ||
      __atomic_load_n(&page->version, __ATOMIC_RELAXED) != kProgressVersion) {
    ::munmap(m, kProgressPageBytes);
    return unusable(path, "not a progress page of version " + std::to_string(kProgressVersion));
  }
  return page;
}

}  // namespace

ProgressReporter::ProgressReporter(const std::string& path)
    : page_(path.empty() ? nullptr : map_page(path)) {}

ProgressReporter ProgressReporter::from_env(const std::map<std::string, std::string>& env) {
  auto it = env.find(kProgressFileVar);
  return ProgressReporter(it == env.end() ? std::string() : it->second);
}

ProgressReporter::~ProgressReporter() {
  if (page_ != nullptr) ::munmap(page_, kProgressPageBytes);
}

ProgressReporter::ProgressReporter(ProgressReporter&& other) noexcept
    : page_(std::exchange(other.page_, nullptr)) {}

ProgressReporter& ProgressReporter::operator=(ProgressReporter&& other) noexcept {
  if (this != &other) {
    if (page_ != nullptr) ::munmap(page_, kProgressPageBytes);
    page_ = std::exchange(other.page_, nullptr);
  }
  return *this;
}

}  // namespace muster::worker
