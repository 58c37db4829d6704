//! Webhook signatures: Ed25519 keys shared by every process through the backend, their JWKS,
//! and the `Webhook-Signature` header (`t=<unix seconds>,kid=<key id>,ed25519=<base64url
//! signature of "<t>.<body>">`, the reference server's format).
//!
//! A key id is `ds_` and the base64url SHA-256 of the key's RFC 7638 JWK thumbprint input
//! (`{"crv":"Ed25519","kty":"OKP","x":…}`). Rotation makes a new key current; the previous keys
//! stay published in the JWKS for [`RETIRED_KEY_GRACE_MS`] so receivers can verify deliveries
//! signed just before it.

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use ed25519_dalek::{Signer, SigningKey};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// How long a retired key stays in the JWKS after rotation: 7 days, ms.
pub const RETIRED_KEY_GRACE_MS: u64 = 7 * 24 * 3600 * 1000;

/// One signing key as stored (the private half base64url-encoded).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredKey {
    pub kid: String,
    /// The 32-byte Ed25519 seed, base64url without padding.
    pub d: String,
    /// The 32-byte public key, base64url without padding.
    pub x: String,
    /// Made current at, ms since the Unix epoch.
    pub created_ms: u64,
    /// Replaced by a newer key at, ms since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retired_ms: Option<u64>,
}

impl StoredKey {
    /// A new random key.
    pub fn generate(now_ms: u64) -> StoredKey {
        let mut seed = [0u8; 32];
        rand::rng().fill_bytes(&mut seed);
        let sk = SigningKey::from_bytes(&seed);
        let x = B64.encode(sk.verifying_key().as_bytes());
        let thumb = format!(r#"{{"crv":"Ed25519","kty":"OKP","x":"{x}"}}"#);
        let kid = format!("ds_{}", B64.encode(Sha256::digest(thumb.as_bytes())));
        StoredKey { kid, d: B64.encode(seed), x, created_ms: now_ms, retired_ms: None }
    }

    fn signing_key(&self) -> Option<SigningKey> {
        let seed: [u8; 32] = B64.decode(&self.d).ok()?.try_into().ok()?;
        Some(SigningKey::from_bytes(&seed))
    }

    /// The public JWK (`kty` OKP, `crv` Ed25519, `x`, `kid`, `use` sig, `alg` EdDSA).
    pub fn jwk(&self) -> Value {
        json!({"kty": "OKP", "crv": "Ed25519", "x": self.x, "kid": self.kid, "use": "sig", "alg": "EdDSA"})
    }
}

/// The key set: the current key first, then retired ones still published.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyRing {
    pub keys: Vec<StoredKey>,
}

impl KeyRing {
    /// The current key (the one not retired, newest).
    pub fn current(&self) -> Option<&StoredKey> {
        self.keys.iter().filter(|k| k.retired_ms.is_none()).max_by_key(|k| k.created_ms)
    }

    /// The JWKS document: `{"keys": [...]}`, current key first, retired keys within their grace.
    pub fn jwks(&self, now_ms: u64) -> Value {
        let mut keys: Vec<&StoredKey> =
            self.keys.iter().filter(|k| k.retired_ms.is_none_or(|r| now_ms < r + RETIRED_KEY_GRACE_MS)).collect();
        keys.sort_by_key(|k| (k.retired_ms.is_some(), std::cmp::Reverse(k.created_ms)));
        json!({ "keys": keys.iter().map(|k| k.jwk()).collect::<Vec<_>>() })
    }

    /// The `Webhook-Signature` header for `body` at `unix_seconds`, with the current key.
    /// `None` when the ring has no usable key.
    pub fn sign(&self, body: &[u8], unix_seconds: u64) -> Option<String> {
        let k = self.current()?;
        let sk = k.signing_key()?;
        let mut msg = format!("{unix_seconds}.").into_bytes();
        msg.extend_from_slice(body);
        let sig = sk.sign(&msg);
        Some(format!("t={unix_seconds},kid={},ed25519={}", k.kid, B64.encode(sig.to_bytes())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signature, Verifier, VerifyingKey};

    #[test]
    fn signs_and_verifies() {
        let ring = KeyRing { keys: vec![StoredKey::generate(1)] };
        let h = ring.sign(b"{\"a\":1}", 1700000000).unwrap();
        let (t, rest) = h.strip_prefix("t=").unwrap().split_once(",kid=").unwrap();
        let (kid, sig) = rest.split_once(",ed25519=").unwrap();
        assert_eq!(t, "1700000000");
        assert!(kid.starts_with("ds_"));
        let jwks = ring.jwks(2);
        let x = jwks["keys"][0]["x"].as_str().unwrap();
        let vk = VerifyingKey::from_bytes(&B64.decode(x).unwrap().try_into().unwrap()).unwrap();
        let sig = Signature::from_bytes(&B64.decode(sig).unwrap().try_into().unwrap());
        vk.verify(b"1700000000.{\"a\":1}", &sig).unwrap();
        assert!(vk.verify(b"1700000001.{\"a\":1}", &sig).is_err());
    }

    #[test]
    fn retired_keys_stay_for_the_grace() {
        let mut old = StoredKey::generate(1);
        old.retired_ms = Some(10);
        let new = StoredKey::generate(10);
        let ring = KeyRing { keys: vec![old.clone(), new.clone()] };
        assert_eq!(ring.current().unwrap().kid, new.kid);
        let j = ring.jwks(11);
        assert_eq!(j["keys"][0]["kid"], new.kid.as_str());
        assert_eq!(j["keys"][1]["kid"], old.kid.as_str());
        assert_eq!(ring.jwks(10 + RETIRED_KEY_GRACE_MS)["keys"].as_array().unwrap().len(), 1);
    }
}
