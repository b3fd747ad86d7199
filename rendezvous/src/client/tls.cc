#include "muster/rendezvous/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace muster::rendezvous {
namespace {

absl::Status bad(absl::string_view setting, const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(setting, " ", path, ": ", what));
}

// The file's text, bounded; errors name the setting and the file.
absl::StatusOr<std::string> read_bounded(absl::string_view setting, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return bad(setting, path, absl::StrCat("cannot read it (", std::strerror(errno), ")"));
  std::string text(kMaxTlsFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return bad(setting, path, "cannot read it");
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > kMaxTlsFileBytes) {
    return bad(setting, path, absl::StrCat("is larger than ", kMaxTlsFileBytes >> 10, " KiB"));
  }
  return text;
}

struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;

std::unique_ptr<BIO, BioFree> memory_bio(const std::string& text) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// Never asks for a passphrase: an encrypted key fails to load (gRPC cannot use one).
int no_passphrase(char*, int, int, void*) { return -1; }

std::string asn1_time_text(const ASN1_TIME* t) {
  std::unique_ptr<BIO, BioFree> out(BIO_new(BIO_s_mem()));
  if (!out || ASN1_TIME_print(out.get(), t) != 1) return "?";
  char* data = nullptr;
  const long n = BIO_get_mem_data(out.get(), &data);
  return std::string(data, static_cast<std::size_t>(n));
}

// The first certificate of a PEM file, and how many it holds.
absl::StatusOr<X509Ptr> first_certificate(absl::string_view setting, const std::string& path,
                                          const std::string& pem) {
  auto bio = memory_bio(pem);
  X509Ptr first(PEM_read_bio_X509(bio.get(), nullptr, no_passphrase, nullptr));
  ERR_clear_error();
  if (!first) return bad(setting, path, "holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
  return first;
}

// A certificate this side presents: in its validity period by this machine's clock.
absl::Status check_validity(absl::string_view setting, const std::string& path, X509* cert) {
  if (X509_cmp_current_time(X509_get0_notAfter(cert)) < 0) {
    return bad(setting, path,
               absl::StrCat("the certificate expired on ", asn1_time_text(X509_get0_notAfter(cert))));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert)) > 0) {
    return bad(setting, path, absl::StrCat("the certificate is not valid before ",
                                           asn1_time_text(X509_get0_notBefore(cert))));
  }
  return absl::OkStatus();
}

absl::StatusOr<KeyPtr> private_key(absl::string_view setting, const std::string& path,
                                   const std::string& pem) {
  if (absl::StrContains(pem, "ENCRYPTED")) {
    return bad(setting, path, "the key is encrypted; give it unencrypted (e.g. openssl pkey -in "
                              "KEY -out PLAIN), readable only by the daemon's user");
  }
  auto bio = memory_bio(pem);
  KeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, no_passphrase, nullptr));
  ERR_clear_error();
  if (!key) return bad(setting, path, "holds no PEM private key (-----BEGIN PRIVATE KEY-----)");
  return key;
}

// A certificate and its key, as one side presents them.
struct Pair {
  std::string cert_pem, key_pem;
};
absl::StatusOr<Pair> load_pair(absl::string_view cert_setting, const std::string& cert_path,
                               absl::string_view key_setting, const std::string& key_path) {
  Pair p;
  auto cert_text = read_bounded(cert_setting, cert_path);
  if (!cert_text.ok()) return cert_text.status();
  auto key_text = read_bounded(key_setting, key_path);
  if (!key_text.ok()) return key_text.status();
  auto cert = first_certificate(cert_setting, cert_path, *cert_text);
  if (!cert.ok()) return cert.status();
  auto key = private_key(key_setting, key_path, *key_text);
  if (!key.ok()) return key.status();
  if (X509_check_private_key(cert->get(), key->get()) != 1) {
    ERR_clear_error();
    return bad(key_setting, key_path, absl::StrCat("is not the key of ", cert_setting, " ", cert_path));
  }
  if (absl::Status s = check_validity(cert_setting, cert_path, cert->get()); !s.ok()) return s;
  p.cert_pem = std::move(*cert_text);
  p.key_pem = std::move(*key_text);
  return p;
}

absl::StatusOr<std::string> load_ca(absl::string_view setting, const std::string& path) {
  auto text = read_bounded(setting, path);
  if (!text.ok()) return text.status();
  if (auto c = first_certificate(setting, path, *text); !c.ok()) return c.status();
  return text;
}

}  // namespace

absl::StatusOr<ServerTls> load_server_tls(const ServerTlsFiles& files) {
  ServerTls tls;
  tls.files = files;
  if (!files.any()) return tls;
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together: give both");
  }
  if (files.cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls_ca (mutual TLS: the CA of the clients' certificates) needs --tls_cert and "
        "--tls_key");
  }
  auto pair = load_pair("--tls_cert", files.cert, "--tls_key", files.key);
  if (!pair.ok()) return pair.status();
  tls.cert_pem = std::move(pair->cert_pem);
  tls.key_pem = std::move(pair->key_pem);
  if (!files.client_ca.empty()) {
    auto ca = load_ca("--tls_ca", files.client_ca);
    if (!ca.ok()) return ca.status();
    tls.client_ca_pem = std::move(*ca);
  }
  return tls;
}

absl::StatusOr<ClientTls> load_client_tls(const ClientTlsFiles& files) {
  ClientTls tls;
  tls.files = files;
  if (!files.any()) return tls;
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("tls_cert and tls_key go together: give both");
  }
  if (files.ca.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        files.cert.empty() ? "tls_server_name" : "tls_cert",
        " needs tls_ca (the CA that signed the server's certificate)"));
  }
  auto ca = load_ca("tls_ca", files.ca);
  if (!ca.ok()) return ca.status();
  tls.ca_pem = std::move(*ca);
  if (!files.cert.empty()) {
    auto pair = load_pair("tls_cert", files.cert, "tls_key", files.key);
    if (!pair.ok()) return pair.status();
    tls.cert_pem = std::move(pair->cert_pem);
    tls.key_pem = std::move(pair->key_pem);
  }
  return tls;
}

ClientTlsFiles client_tls_files_from_env(const std::map<std::string, std::string>& env) {
  auto get = [&env](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  return ClientTlsFiles{get(kTlsCaVar), get(kTlsCertVar), get(kTlsKeyVar), get(kTlsServerNameVar)};
}

std::map<std::string, std::string> client_tls_env(const ClientTlsFiles& files) {
  std::map<std::string, std::string> env;
  if (files.ca.empty()) return env;
  env[kTlsCaVar] = files.ca;
  if (!files.cert.empty()) env[kTlsCertVar] = files.cert;
  if (!files.key.empty()) env[kTlsKeyVar] = files.key;
  if (!files.server_name.empty()) env[kTlsServerNameVar] = files.server_name;
  return env;
}

std::shared_ptr<grpc::ServerCredentials> server_credentials(const ServerTls& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions opts(
      tls.mutual() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  opts.pem_root_certs = tls.client_ca_pem;
  opts.pem_key_cert_pairs.push_back({tls.key_pem, tls.cert_pem});
  return grpc::SslServerCredentials(opts);
}

std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const ClientTls& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions opts;
  opts.pem_root_certs = tls.ca_pem;
  opts.pem_private_key = tls.key_pem;
  opts.pem_cert_chain = tls.cert_pem;
  return grpc::SslCredentials(opts);
}

void add_tls_channel_args(const ClientTls& tls, grpc::ChannelArguments& args) {
  if (tls.enabled() && !tls.files.server_name.empty()) {
    args.SetSslTargetNameOverride(tls.files.server_name);
  }
}

}  // namespace muster::rendezvous
