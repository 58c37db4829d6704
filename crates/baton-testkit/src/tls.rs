//! Throwaway TLS certificates for tests, made with the `openssl` command-line tool.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use super::TempDir;

/// The `openssl` configuration the certificates are made with: v3 extensions for a CA, a server
/// certificate (`localhost` and `127.0.0.1`) and a client certificate.
const OPENSSL_CNF: &str = "\
[req]
distinguished_name = dn
prompt = no

[dn]
CN = baton-test

[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash

[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid

[client_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
";

/// A fresh set of PEM files in a temporary directory (removed when the last clone is dropped):
///
/// * a CA (`ca.crt`, `ca.key`);
/// * a server certificate signed by it, subjectAltName `DNS:localhost, IP:127.0.0.1`
///   (`server.crt`, `server.key`);
/// * a client certificate signed by it (`client.crt`, `client.key`);
/// * a second, unrelated CA (`other-ca.crt`), for "wrong CA" tests.
///
/// Keys are EC P-256 in unencrypted PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`); certificates
/// are X.509 v3, valid for 10 years. Cheap to clone (the files are shared): a [`RedisServer`]
/// started with them keeps a clone, so its restart still finds them.
///
/// [`RedisServer`]: crate::RedisServer
#[derive(Clone)]
pub struct TestCerts {
    dir: Arc<TempDir>,
}

impl TestCerts {
    /// Generates a new set (six `openssl` runs, tens of milliseconds). Panics when `openssl` is
    /// missing or fails, with its output.
    pub fn generate() -> TestCerts {
        let dir = TempDir::new("baton-certs");
        let d = dir.path();
        std::fs::write(d.join("openssl.cnf"), OPENSSL_CNF)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", d.join("openssl.cnf").display()));
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];

        for (name, cn) in [("ca", "Baton Test CA"), ("other-ca", "Baton Unrelated Test CA")] {
            let (key, crt) = (format!("{name}.key"), format!("{name}.crt"));
            openssl(d, &["req", "-x509", "-new"], &ec, &["-keyout", &key, "-out", &crt, "-days", "3650"], cn, "ca_ext");
        }
        for (name, cn, ext) in [("server", "localhost", "server_ext"), ("client", "baton-test-client", "client_ext")] {
            let (key, csr, crt) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.crt"));
            openssl(d, &["req", "-new"], &ec, &["-keyout", &key, "-out", &csr], cn, "");
            run_openssl(
                d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.crt",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-out",
                    &crt,
                    "-days",
                    "3650",
                    "-extfile",
                    "openssl.cnf",
                    "-extensions",
                    ext,
                ],
            );
        }
        TestCerts { dir: Arc::new(dir) }
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA certificate (PEM) that signed the server and client certificates.
    pub fn ca_cert(&self) -> PathBuf {
        self.dir().join("ca.crt")
    }

    /// A CA certificate (PEM) unrelated to the others: verifying the server with it must fail.
    pub fn other_ca_cert(&self) -> PathBuf {
        self.dir().join("other-ca.crt")
    }

    /// The server certificate (PEM), for `localhost` and `127.0.0.1`.
    pub fn server_cert(&self) -> PathBuf {
        self.dir().join("server.crt")
    }

    /// The server's private key (PKCS#8 PEM).
    pub fn server_key(&self) -> PathBuf {
        self.dir().join("server.key")
    }

    /// The client certificate (PEM), signed by [`TestCerts::ca_cert`].
    pub fn client_cert(&self) -> PathBuf {
        self.dir().join("client.crt")
    }

    /// The client's private key (PKCS#8 PEM).
    pub fn client_key(&self) -> PathBuf {
        self.dir().join("client.key")
    }
}

impl fmt::Debug for TestCerts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestCerts").field("dir", &self.dir()).finish()
    }
}

/// `openssl REQ… KEYARGS… OUT… -subj /CN=cn -config openssl.cnf [-extensions ext]` in `dir`.
fn openssl(dir: &Path, req: &[&str], key: &[&str], out: &[&str], cn: &str, ext: &str) {
    let subj = format!("/CN={cn}");
    let mut args: Vec<&str> = req.iter().chain(key).chain(out).copied().collect();
    args.extend(["-subj", &subj, "-config", "openssl.cnf"]);
    if !ext.is_empty() {
        args.extend(["-extensions", ext]);
    }
    run_openssl(dir, &args);
}

fn run_openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl (install the Debian package `openssl`): {e}"));
    if !out.status.success() {
        panic!(
            "openssl {} failed ({}):\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
