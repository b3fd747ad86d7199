#include "certs.h"

#include <unistd.h>

#include <fstream>
#include <stdexcept>
#include <vector>

namespace muster::testing {
namespace {

// One config for every step, so that nothing depends on the system's openssl.cnf.
constexpr char kConfig[] = R"([req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
# `openssl ca`, for the one certificate whose dates are in the past.
[ca]
default_ca = test_ca
[test_ca]
database = index.txt
new_certs_dir = .
serial = serial
certificate = ca.pem
private_key = ca.key
default_md = sha256
policy = any_name
unique_subject = no
[any_name]
commonName = supplied
)";

void write(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

class Maker {
 public:
  Maker(std::string openssl, const TempDir& dir) : openssl_(std::move(openssl)), dir_(dir) {
    write(dir_.file("openssl.cnf"), kConfig);
    write(dir_.file("index.txt"), "");
    write(dir_.file("serial"), "1000\n");
  }

  // openssl ARGS..., run in the folder.
  void run(std::vector<std::string> args) {
    std::vector<std::string> argv{"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", dir_.path(), openssl_};
    argv.insert(argv.end(), args.begin(), args.end());
    Proc p(argv, {{"OPENSSL_CONF", dir_.file("openssl.cnf")}});
    const auto code = p.wait(60s);
    if (code != 0) {
      std::string cmd = "openssl";
      for (const auto& a : args) cmd += " " + a;
      throw std::runtime_error(cmd + " failed: " + p.err());
    }
  }

  // A P-256 key and a signing request for CN=`cn`.
  void request(const std::string& name, const std::string& cn) {
    run({"req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-config", "openssl.cnf", "-subj", "/CN=" + cn, "-keyout", name + ".key", "-out",
         name + ".csr"});
  }
  void self_signed_ca(const std::string& name, const std::string& cn) {
    run({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-config", "openssl.cnf", "-extensions", "ca_ext", "-subj", "/CN=" + cn, "-days", "2",
         "-keyout", name + ".key", "-out", name + ".pem"});
  }
  void sign(const std::string& name, const std::string& ca, const std::string& ext) {
    run({"x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
         "-CAcreateserial", "-days", "2", "-extfile", "openssl.cnf", "-extensions", ext, "-out",
         name + ".pem"});
  }

 private:
  std::string openssl_;
  const TempDir& dir_;
};

}  // namespace

std::string find_openssl() { return find_on_path("openssl"); }

std::unique_ptr<TestCerts> make_test_certs(const std::string& openssl) {
  auto c = std::make_unique<TestCerts>();
  Maker m(openssl, c->dir);
  m.self_signed_ca("ca", "muster-test-ca");
  m.request("server", "localhost");
  m.sign("server", "ca", "server_ext");
  m.request("client", "agent");
  m.sign("client", "ca", "client_ext");
  m.self_signed_ca("other_ca", "unrelated-ca");
  m.request("other_client", "agent");
  m.sign("other_client", "other_ca", "client_ext");
  // `openssl x509` takes no dates in the past; `openssl ca` does.
  m.request("expired", "localhost");
  m.run({"ca", "-batch", "-config", "openssl.cnf", "-notext", "-in", "expired.csr", "-out",
         "expired.pem", "-startdate", "20200101000000Z", "-enddate", "20200102000000Z",
         "-extfile", "openssl.cnf", "-extensions", "server_ext"});
  const TempDir& d = c->dir;
  c->ca = d.file("ca.pem");
  c->ca_key = d.file("ca.key");
  c->server_cert = d.file("server.pem");
  c->server_key = d.file("server.key");
  c->client_cert = d.file("client.pem");
  c->client_key = d.file("client.key");
  c->other_ca = d.file("other_ca.pem");
  c->other_client_cert = d.file("other_client.pem");
  c->other_client_key = d.file("other_client.key");
  c->expired_cert = d.file("expired.pem");
  c->expired_key = d.file("expired.key");
  return c;
}

}  // namespace muster::testing
