//! Which webhook URLs Baton will call: checked when a subscription is created (the URL's host)
//! and again at every delivery (every address the host resolves to, so a name that resolves to
//! a private address later is refused too).
//!
//! Refused: schemes other than `https` (and `http` to loopback when loopback is allowed);
//! private (10/8, 172.16/12, 192.168/16, fc00::/7), shared (100.64/10), link-local
//! (169.254/16, fe80::/10, which holds cloud metadata services such as 169.254.169.254),
//! unspecified (0/8, ::), broadcast and multicast addresses, and the IPv6 forms of any of these
//! (IPv4-mapped); loopback (127/8, ::1, `localhost`) unless `allow_loopback`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use crate::model::{Result, SubscriptionError};

fn rejected(m: impl Into<String>) -> SubscriptionError {
    SubscriptionError::WebhookUrlRejected(m.into())
}

/// Whether an address is one Baton refuses to call (see the module docs). Loopback addresses
/// pass only with `allow_loopback`.
pub fn address_refused(ip: IpAddr, allow_loopback: bool) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_refused(v4, allow_loopback),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return v4_refused(v4, allow_loopback);
            }
            v6_refused(v6, allow_loopback)
        }
    }
}

fn v4_refused(ip: Ipv4Addr, allow_loopback: bool) -> Option<&'static str> {
    let o = ip.octets();
    if ip.is_loopback() {
        return (!allow_loopback).then_some(
            "loopback addresses are refused (start baton with --allow-loopback-webhooks for local development)",
        );
    }
    if ip.is_private() || (o[0] == 100 && (64..128).contains(&o[1])) {
        return Some("private addresses are refused");
    }
    if ip.is_link_local() {
        return Some("link-local addresses (cloud metadata among them) are refused");
    }
    if o[0] == 0 || ip.is_broadcast() || ip.is_multicast() || o[0] >= 240 {
        return Some("unspecified, broadcast, multicast and reserved addresses are refused");
    }
    None
}

fn v6_refused(ip: Ipv6Addr, allow_loopback: bool) -> Option<&'static str> {
    let s = ip.segments();
    if ip.is_loopback() {
        return (!allow_loopback).then_some(
            "loopback addresses are refused (start baton with --allow-loopback-webhooks for local development)",
        );
    }
    if ip.is_unspecified() || ip.is_multicast() {
        return Some("unspecified and multicast addresses are refused");
    }
    if (s[0] & 0xfe00) == 0xfc00 {
        return Some("private (unique local) addresses are refused");
    }
    if (s[0] & 0xffc0) == 0xfe80 {
        return Some("link-local addresses are refused");
    }
    // IPv4-compatible (deprecated) and NAT64 forms of internal IPv4 addresses.
    if s[0..6] == [0, 0, 0, 0, 0, 0] || (s[0] == 0x64 && s[1] == 0xff9b) {
        let v4 = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
        return v4_refused(v4, allow_loopback);
    }
    None
}

fn is_loopback_host(host: &str) -> bool {
    host == "localhost" || host.ends_with(".localhost")
}

/// Checks a webhook URL when a subscription is created: a valid absolute URL with a host;
/// `https`, or `http` only to a loopback host when `allow_loopback`; an IP-literal host must
/// not be refused by [`address_refused`]. Errors: `WebhookUrlRejected` naming every problem at
/// once (`http://10.1.2.3` is told both that it must use https and that 10.1.2.3 is private),
/// joined with `; `.
pub fn check_url(raw: &str, allow_loopback: bool) -> Result<url::Url> {
    let url = url::Url::parse(raw).map_err(|_| rejected("webhook.url must be a valid absolute URL"))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(rejected("webhook.url must not contain credentials"));
    }
    let host = match url.host() {
        Some(h) => h,
        None => return Err(rejected("webhook.url needs a host")),
    };
    let (ip, loopback) = match &host {
        url::Host::Ipv4(v4) => (Some(IpAddr::V4(*v4)), v4.is_loopback()),
        url::Host::Ipv6(v6) => {
            (Some(IpAddr::V6(*v6)), v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v| v.is_loopback()))
        }
        url::Host::Domain(d) => (None, is_loopback_host(&d.to_ascii_lowercase())),
    };
    let mut problems: Vec<String> = vec![];
    match url.scheme() {
        "https" => {}
        "http" if loopback && allow_loopback => {}
        "http" => problems
            .push("webhook.url must use https (http only for loopback hosts, with --allow-loopback-webhooks)".into()),
        _ => problems.push("webhook.url must use https".into()),
    }
    if loopback && !allow_loopback {
        problems.push(
            "webhook.url must not target loopback hosts (start baton with --allow-loopback-webhooks for local development)"
                .into(),
        );
    } else if let Some(why) = ip.and_then(|ip| address_refused(ip, allow_loopback)) {
        problems.push(format!("webhook.url must not target {}: {why}", ip.expect("an address")));
    }
    if problems.is_empty() {
        Ok(url)
    } else {
        Err(rejected(problems.join("; ")))
    }
}

/// A DNS resolver for the webhook client that drops refused addresses (and fails when nothing
/// is left), so a delivery never connects to an address [`check_url`] would refuse.
#[derive(Clone)]
pub struct FilteringResolver {
    pub allow_loopback: bool,
}

impl reqwest::dns::Resolve for FilteringResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allow = self.allow_loopback;
        let host = name.as_str().to_string();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let kept: Vec<SocketAddr> =
                addrs.iter().copied().filter(|a| address_refused(a.ip(), allow).is_none()).collect();
            if kept.is_empty() {
                let e: Box<dyn std::error::Error + Send + Sync> =
                    format!("webhook host {host} resolves only to refused addresses ({addrs:?})").into();
                return Err(e);
            }
            let it: reqwest::dns::Addrs = Box::new(kept.into_iter());
            Ok(it)
        })
    }
}

/// The HTTP client for deliveries (subscription and completion webhooks): no redirects, a
/// `timeout` per request, DNS through a resolver that drops the addresses [`address_refused`]
/// refuses, and no proxy (`HTTP_PROXY` / `HTTPS_PROXY` are ignored: through a proxy the resolver
/// would check the proxy's address instead of the webhook's, and the address rules would not
/// hold).
pub fn client(allow_loopback: bool, timeout: std::time::Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(timeout)
        .dns_resolver(Arc::new(FilteringResolver { allow_loopback }))
        .user_agent(concat!("baton/", env!("CARGO_PKG_VERSION")))
        .build()
        .expect("a reqwest client")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert!(check_url("https://hooks.example.com/x", false).is_ok());
        for bad in [
            "http://10.0.0.1/hook",
            "https://10.0.0.1/hook",
            "https://172.16.3.4/",
            "https://192.168.1.1/",
            "https://169.254.169.254/latest",
            "https://100.64.0.1/",
            "https://[fd00:ec2::254]/",
            "https://[fe80::1]/",
            "https://[::ffff:10.0.0.1]/",
            "https://0.0.0.0/",
            "http://example.com/",
            "ftp://example.com/",
            "https://user:pw@example.com/",
            "http://127.0.0.1:8080/",
            "http://localhost/",
            "https://[::1]/",
            "not a url",
        ] {
            let e = check_url(bad, false).unwrap_err();
            assert_eq!(e.code(), "WEBHOOK_URL_REJECTED", "{bad}");
        }
        assert!(check_url("http://127.0.0.1:8080/hook", true).is_ok());
        assert!(check_url("http://localhost:1/", true).is_ok());
        assert!(check_url("http://10.0.0.1/", true).is_err());
    }

    #[test]
    fn every_problem_is_named() {
        let msg = |u: &str, allow: bool| check_url(u, allow).unwrap_err().to_string();
        assert_eq!(
            msg("http://10.1.2.3", false),
            "webhook.url must use https (http only for loopback hosts, with --allow-loopback-webhooks); \
             webhook.url must not target 10.1.2.3: private addresses are refused"
        );
        assert_eq!(
            msg("http://10.1.2.3", true),
            "webhook.url must use https (http only for loopback hosts, with --allow-loopback-webhooks); \
             webhook.url must not target 10.1.2.3: private addresses are refused"
        );
        assert_eq!(
            msg("https://10.1.2.3", false),
            "webhook.url must not target 10.1.2.3: private addresses are refused"
        );
        assert_eq!(
            msg("http://example.com", false),
            "webhook.url must use https (http only for loopback hosts, with --allow-loopback-webhooks)"
        );
        assert_eq!(
            msg("http://127.0.0.1:1/", false),
            "webhook.url must use https (http only for loopback hosts, with --allow-loopback-webhooks); webhook.url must not target \
             loopback hosts (start baton with --allow-loopback-webhooks for local development)"
        );
        assert_eq!(
            msg("ftp://169.254.169.254/", false),
            "webhook.url must use https; webhook.url must not target 169.254.169.254: link-local addresses (cloud \
             metadata among them) are refused"
        );
    }
}
