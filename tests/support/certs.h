// Certificates for the TLS tests, made with Debian's `openssl` command (3.0) in a folder of
// their own: a CA, a server certificate it signed (subject alternative names IP:127.0.0.1 and
// DNS:localhost), a client certificate it signed, a second, unrelated CA with a client
// certificate of its own, and a server certificate of the first CA that expired in 2020.
// Every key is an unencrypted P-256 key. The files go with the object.
#pragma once

#include <memory>
#include <string>

#include "proc.h"
#include "skip.h"

namespace muster::testing {

struct TestCerts {
  TempDir dir;
  std::string ca, ca_key;
  std::string server_cert, server_key;
  std::string client_cert, client_key;  // extendedKeyUsage clientAuth, CN=agent
  std::string other_ca;
  std::string other_client_cert, other_client_key;  // signed by other_ca
  std::string expired_cert, expired_key;            // valid 2020-01-01 to 2020-01-02 only
};

// The openssl command, or "" when there is none (the tests then report SKIPPED).
std::string find_openssl();

// Makes them all. Throws std::runtime_error with openssl's own words when a step fails.
std::unique_ptr<TestCerts> make_test_certs(const std::string& openssl);

// For a Catch2 test: the certificates, or null with a SKIPPED warning where there is no
// openssl (the caller returns).
#ifdef CATCH_VERSION_MAJOR
inline std::unique_ptr<TestCerts> test_certs_or_skip() {
  const std::string openssl = find_openssl();
  if (openssl.empty()) {
    report_skip("no openssl command on PATH (Debian's openssl package)");
    return nullptr;
  }
  return make_test_certs(openssl);
}
#endif

}  // namespace muster::testing
