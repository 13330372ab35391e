//! Just enough STUN (RFC 8489) to learn a server-reflexive address: a
//! Binding request and the XOR-MAPPED-ADDRESS of its success response.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

const MAGIC_COOKIE: u32 = 0x2112_A442;
const BINDING_REQUEST: u16 = 0x0001;
const BINDING_SUCCESS: u16 = 0x0101;
const ATTR_MAPPED_ADDRESS: u16 = 0x0001;
const ATTR_XOR_MAPPED_ADDRESS: u16 = 0x0020;

pub(crate) type TransactionId = [u8; 12];

pub(crate) fn binding_request(tid: &TransactionId) -> Vec<u8> {
    let mut m = Vec::with_capacity(20);
    m.extend_from_slice(&BINDING_REQUEST.to_be_bytes());
    m.extend_from_slice(&0u16.to_be_bytes());
    m.extend_from_slice(&MAGIC_COOKIE.to_be_bytes());
    m.extend_from_slice(tid);
    m
}

/// The mapped address in a Binding success response to `tid`; `None` for
/// anything else (other STUN, DTLS, garbage).
pub(crate) fn parse_binding_success(packet: &[u8], tid: &TransactionId) -> Option<SocketAddr> {
    let header = packet.get(..20)?;
    if u16::from_be_bytes([header[0], header[1]]) != BINDING_SUCCESS
        || u32::from_be_bytes([header[4], header[5], header[6], header[7]]) != MAGIC_COOKIE
        || &header[8..20] != tid
    {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([header[2], header[3]]));
    let mut attrs = packet.get(20..20 + len)?;
    let mut plain = None;
    while attrs.len() >= 4 {
        let kind = u16::from_be_bytes([attrs[0], attrs[1]]);
        let alen = usize::from(u16::from_be_bytes([attrs[2], attrs[3]]));
        let value = attrs.get(4..4 + alen)?;
        match kind {
            ATTR_XOR_MAPPED_ADDRESS => return address(value, true, tid),
            ATTR_MAPPED_ADDRESS => plain = address(value, false, tid),
            _ => {}
        }
        let padded = (4 + alen).next_multiple_of(4);
        attrs = attrs.get(padded..).unwrap_or_default();
    }
    plain
}

fn address(value: &[u8], xor: bool, tid: &TransactionId) -> Option<SocketAddr> {
    let family = *value.get(1)?;
    let mut port = u16::from_be_bytes([*value.get(2)?, *value.get(3)?]);
    let cookie = MAGIC_COOKIE.to_be_bytes();
    if xor {
        port ^= (MAGIC_COOKIE >> 16) as u16;
    }
    let ip = match family {
        1 => {
            let mut b: [u8; 4] = value.get(4..8)?.try_into().ok()?;
            if xor {
                b.iter_mut().zip(cookie).for_each(|(x, c)| *x ^= c);
            }
            IpAddr::V4(Ipv4Addr::from(b))
        }
        2 => {
            let mut b: [u8; 16] = value.get(4..20)?.try_into().ok()?;
            if xor {
                let key: Vec<u8> = cookie.iter().chain(tid.iter()).copied().collect();
                b.iter_mut().zip(key).for_each(|(x, k)| *x ^= k);
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// `host` and `port` of a `stun:` URL (`stun:host`, `stun:host:port`,
/// `stun:[v6]:port`); `None` for other schemes.
pub(crate) fn stun_host(url: &str) -> Option<(String, u16)> {
    let rest = url.strip_prefix("stun:")?;
    let rest = rest.split('?').next().unwrap_or(rest);
    if let Some(v6) = rest.strip_prefix('[') {
        let (host, tail) = v6.split_once(']')?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None => 3478,
        };
        return Some((host.to_owned(), port));
    }
    match rest.rsplit_once(':') {
        Some((host, port)) => Some((host.to_owned(), port.parse().ok()?)),
        None => Some((rest.to_owned(), 3478)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A success response as a server would build it.
    pub(crate) fn success(tid: &TransactionId, addr: SocketAddr) -> Vec<u8> {
        let mut value = vec![0u8, 0];
        let port = addr.port() ^ (MAGIC_COOKIE >> 16) as u16;
        let IpAddr::V4(ip) = addr.ip() else {
            unreachable!()
        };
        value[1] = 1;
        value.extend_from_slice(&port.to_be_bytes());
        let mut b = ip.octets();
        b.iter_mut()
            .zip(MAGIC_COOKIE.to_be_bytes())
            .for_each(|(x, c)| *x ^= c);
        value.extend_from_slice(&b);
        let mut m = Vec::new();
        m.extend_from_slice(&BINDING_SUCCESS.to_be_bytes());
        m.extend_from_slice(&((4 + value.len()) as u16).to_be_bytes());
        m.extend_from_slice(&MAGIC_COOKIE.to_be_bytes());
        m.extend_from_slice(tid);
        m.extend_from_slice(&ATTR_XOR_MAPPED_ADDRESS.to_be_bytes());
        m.extend_from_slice(&(value.len() as u16).to_be_bytes());
        m.extend_from_slice(&value);
        m
    }

    #[test]
    fn binding_roundtrip() {
        let tid = [7u8; 12];
        let addr: SocketAddr = "203.0.113.9:40000".parse().unwrap();
        let req = binding_request(&tid);
        assert_eq!(req.len(), 20);
        assert_eq!(
            parse_binding_success(&success(&tid, addr), &tid),
            Some(addr)
        );
        assert_eq!(
            parse_binding_success(&success(&tid, addr), &[8u8; 12]),
            None
        );
        assert_eq!(parse_binding_success(&req, &tid), None);
        assert_eq!(parse_binding_success(&[0xff; 7], &tid), None);
    }

    #[test]
    fn urls() {
        assert_eq!(
            stun_host("stun:example.org"),
            Some(("example.org".into(), 3478))
        );
        assert_eq!(
            stun_host("stun:1.2.3.4:19302"),
            Some(("1.2.3.4".into(), 19302))
        );
        assert_eq!(stun_host("stun:[::1]:5"), Some(("::1".into(), 5)));
        assert_eq!(stun_host("turn:x:1"), None);
    }
}
