// Linked into the self-contained binaries (static_deps.cmake): what keeps them within
// GLIBC_2.34, so that they run on Ubuntu 22.04, Debian 12 and RHEL 9 alike (the wheel's
// manylinux_2_34 tag, docs/install.md).
//
// libstdc++.a's std::random_device, built on glibc 2.36, calls arc4random (GLIBC_2.36). A
// definition in the program wins over the C library's at link time; this one asks the kernel,
// as glibc's does (getrandom, GLIBC_2.25).
#include <sys/random.h>

#include <cerrno>
#include <cstdint>

extern "C" std::uint32_t arc4random(void) {
  std::uint32_t v = 0;
  std::size_t got = 0;
  auto* p = reinterpret_cast<unsigned char*>(&v);
  while (got < sizeof v) {
    const ssize_t n = ::getrandom(p + got, sizeof v - got, 0);
    if (n > 0) got += static_cast<std::size_t>(n);
    // EINTR: again. Anything else cannot happen for 4 bytes with flags 0 (Linux 3.17+).
  }
  return v;
}
