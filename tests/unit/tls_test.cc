// TLS settings: reading and checking the files (rendezvous/tls.h), launch's flags, keys and
// variables (config.cc, tls_config.cc), and what workers are given (worker_env.h).
#include "muster/rendezvous/tls.h"

#include <catch2/catch.hpp>
#include <fstream>

#include "certs.h"
#include "muster/agent/worker_env.h"
#include "muster/launcher/config.h"

using muster::rendezvous::ClientTlsFiles;
using muster::rendezvous::load_client_tls;
using muster::rendezvous::load_server_tls;
using muster::rendezvous::ServerTlsFiles;
using muster::testing::TestCerts;

namespace {

std::unique_ptr<TestCerts> certs() { return muster::testing::test_certs_or_skip(); }

std::string server_error(const ServerTlsFiles& f) {
  auto r = load_server_tls(f);
  REQUIRE_FALSE(r.ok());
  return std::string(r.status().message());
}

std::string client_error(const ClientTlsFiles& f) {
  auto r = load_client_tls(f);
  REQUIRE_FALSE(r.ok());
  return std::string(r.status().message());
}

muster::launcher::ParseResult parse(const std::vector<std::string>& flags,
                                    const std::map<std::string, std::string>& env = {}) {
  muster::launcher::HostInfo host;
  std::vector<std::string> args = flags;
  args.push_back("prog");
  return muster::launcher::parse_launch_args(args, host, env);
}

}  // namespace

TEST_CASE("tls: nothing named is plaintext", "[tls]") {
  auto s = load_server_tls({});
  REQUIRE(s.ok());
  CHECK_FALSE(s->enabled());
  auto c = load_client_tls({});
  REQUIRE(c.ok());
  CHECK_FALSE(c->enabled());
}

TEST_CASE("tls: the server's files are read and checked", "[tls]") {
  auto c = certs();
  if (!c) return;
  auto ok = load_server_tls({c->server_cert, c->server_key, ""});
  REQUIRE(ok.ok());
  CHECK(ok->enabled());
  CHECK_FALSE(ok->mutual());
  CHECK(ok->cert_pem == muster::testing::read_file(c->server_cert));
  auto mutual = load_server_tls({c->server_cert, c->server_key, c->ca});
  REQUIRE(mutual.ok());
  CHECK(mutual->mutual());

  const std::string none = c->dir.file("missing.pem");
  CHECK(server_error({none, c->server_key, ""}) ==
        "--tls_cert " + none + ": cannot read it (No such file or directory)");
  CHECK(server_error({c->server_cert, "", ""}) == "--tls_cert and --tls_key go together: give both");
  CHECK(server_error({"", "", c->ca}) ==
        "--tls_ca (mutual TLS: the CA of the clients' certificates) needs --tls_cert and --tls_key");
  // A key that is not the certificate's, the key and certificate swapped, an expired one.
  CHECK(server_error({c->server_cert, c->client_key, ""}) ==
        "--tls_key " + c->client_key + ": is not the key of --tls_cert " + c->server_cert);
  CHECK(server_error({c->server_key, c->server_cert, ""}) ==
        "--tls_cert " + c->server_key +
            ": holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
  CHECK(server_error({c->expired_cert, c->expired_key, ""}) ==
        "--tls_cert " + c->expired_cert + ": the certificate expired on Jan  2 00:00:00 2020 GMT");
  CHECK(server_error({c->server_cert, c->server_key, c->server_key}) ==
        "--tls_ca " + c->server_key + ": holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
  // An encrypted key is refused with what to do about it.
  const std::string encrypted = c->dir.file("encrypted.key");
  std::ofstream(encrypted) << "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n"
                              "-----END ENCRYPTED PRIVATE KEY-----\n";
  CHECK_THAT(server_error({c->server_cert, encrypted, ""}),
             Catch::StartsWith("--tls_key " + encrypted + ": the key is encrypted"));
  // Bounded.
  const std::string big = c->dir.file("big.pem");
  std::ofstream(big) << std::string(muster::rendezvous::kMaxTlsFileBytes + 1, 'x');
  CHECK(server_error({big, c->server_key, ""}) == "--tls_cert " + big + ": is larger than 1024 KiB");
}

TEST_CASE("tls: a client's files are read and checked", "[tls]") {
  auto c = certs();
  if (!c) return;
  auto plain_ca = load_client_tls({c->ca, "", "", ""});
  REQUIRE(plain_ca.ok());
  CHECK(plain_ca->enabled());
  CHECK(plain_ca->cert_pem.empty());
  auto mutual = load_client_tls({c->ca, c->client_cert, c->client_key, "localhost"});
  REQUIRE(mutual.ok());
  CHECK_FALSE(mutual->key_pem.empty());
  CHECK(mutual->files.server_name == "localhost");
  CHECK(client_error({"", c->client_cert, c->client_key, ""}) ==
        "tls_cert needs tls_ca (the CA that signed the server's certificate)");
  CHECK(client_error({"", "", "", "localhost"}) ==
        "tls_server_name needs tls_ca (the CA that signed the server's certificate)");
  CHECK(client_error({c->ca, c->client_cert, "", ""}) == "tls_cert and tls_key go together: give both");
  CHECK(client_error({c->ca_key, "", "", ""}) ==
        "tls_ca " + c->ca_key + ": holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
  CHECK(client_error({c->ca, c->client_cert, c->server_key, ""}) ==
        "tls_key " + c->server_key + ": is not the key of tls_cert " + c->client_cert);
}

TEST_CASE("tls: launch's flags, --rdzv_conf keys and MUSTER_TLS_* variables", "[tls][config]") {
  auto c = certs();
  if (!c) return;
  const std::string conf = "--rdzv_conf=tls_ca=" + c->ca + ",tls_cert=" + c->client_cert +
                           ",tls_key=" + c->client_key;
  auto r = parse({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29400",
                  "--tls_cert=" + c->server_cert, "--tls_key=" + c->server_key,
                  "--tls_ca=" + c->ca, conf});
  INFO(r.error.message());
  REQUIRE(r.config);
  CHECK(r.config->server_tls.mutual());
  CHECK(r.config->client_tls.enabled());
  CHECK_FALSE(r.config->client_tls.cert_pem.empty());
  CHECK(r.config->client_tls.files.server_name == "node0");  // the endpoint's host, as given

  // The variables stand in for keys --rdzv_conf leaves out; a key given wins.
  auto from_env = parse({"--standalone", "--rdzv_conf=tls_server_name=rdzv.example"},
                        {{"MUSTER_TLS_CA", c->ca}, {"MUSTER_TLS_SERVER_NAME", "ignored"}});
  INFO(from_env.error.message());
  REQUIRE(from_env.config);
  CHECK(from_env.config->client_tls.enabled());
  CHECK(from_env.config->client_tls.files.ca == c->ca);
  CHECK(from_env.config->client_tls.files.server_name == "rdzv.example");
  auto embedded = parse({"--standalone", "--rdzv_conf=tls_ca=" + c->ca});
  REQUIRE(embedded.config);
  CHECK(embedded.config->client_tls.files.server_name == "localhost");
  // launch's own flags take no prefix away from torchrun's: --t is still --tee.
  auto tee = parse({"--standalone", "--t=3", "--log_dir=" + c->dir.path()});
  INFO(tee.error.message());
  REQUIRE(tee.config);
  CHECK(tee.config->tee == "3");

  auto err = [](const muster::launcher::ParseResult& p) {
    REQUIRE_FALSE(p.config);
    return std::string(p.error.message());
  };
  CHECK(err(parse({"--standalone", "--tls_cert=" + c->server_cert, "--tls_key=" + c->server_key})) ==
        "--tls_cert: the agents verify the server they reach, this launch's own too: give "
        "--rdzv_conf tls_ca=CA_FILE (or MUSTER_TLS_CA)");
  CHECK(err(parse({"--standalone", "--tls_cert=" + c->server_cert, "--tls_key=" + c->server_key,
                   "--tls_ca=" + c->ca, "--rdzv_conf=tls_ca=" + c->ca})) ==
        "--tls_ca asks every agent for a client certificate, this launch's own too: give "
        "--rdzv_conf tls_cert=FILE,tls_key=FILE (or MUSTER_TLS_CERT, MUSTER_TLS_KEY)");
  CHECK(err(parse({"--standalone", "--rdzv_conf=tls_ca=" + c->dir.file("nope")})) ==
        "tls_ca " + c->dir.file("nope") + ": cannot read it (No such file or directory)");
  CHECK(err(parse({"--hosts=a,b", "--rdzv_endpoint=a:29400", "--tls_cert=" + c->server_cert,
                   "--tls_key=" + c->server_key, "--rdzv_conf=tls_ca=" + c->ca})) ==
        "--tls_cert, --tls_key and --tls_ca are for the rendezvous this command hosts; with "
        "--rdzv_endpoint it hosts none (give them to the server there)");
  // With --hosts the client files are the hosts' own: not read here; the driver's flags are
  // not passed on to the agents (they do not host).
  auto cluster = parse({"--hosts=a,b", "--tls_cert=" + c->server_cert,
                        "--tls_key=" + c->server_key, "--rdzv_conf=tls_ca=/on/the/hosts/ca.pem"});
  INFO(cluster.error.message());
  REQUIRE(cluster.config);
  CHECK(cluster.config->server_tls.enabled());
  CHECK_FALSE(cluster.config->client_tls.enabled());
  for (const std::string& a : cluster.config->cluster.agent_args) {
    CHECK_THAT(a, !Catch::Contains("--tls_"));
  }
}

TEST_CASE("tls: workers get exactly the agent's TLS settings", "[tls][worker_env]") {
  muster::agent::WorkerEnvSpec spec;
  spec.tls = {"/etc/muster/ca.pem", "/etc/muster/agent.pem", "/etc/muster/agent.key", "node0"};
  auto env = muster::agent::build_worker_env({{"MUSTER_TLS_CA", "/inherited"}}, spec);
  CHECK(env["MUSTER_TLS_CA"] == "/etc/muster/ca.pem");
  CHECK(env["MUSTER_TLS_CERT"] == "/etc/muster/agent.pem");
  CHECK(env["MUSTER_TLS_KEY"] == "/etc/muster/agent.key");
  CHECK(env["MUSTER_TLS_SERVER_NAME"] == "node0");
  muster::agent::WorkerEnvSpec plain;
  auto none = muster::agent::build_worker_env(
      {{"MUSTER_TLS_CA", "/inherited"}, {"MUSTER_TLS_KEY", "/k"}}, plain);
  CHECK(none.count("MUSTER_TLS_CA") == 0);
  CHECK(none.count("MUSTER_TLS_KEY") == 0);
}
