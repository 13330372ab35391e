use proptest::prelude::*;

use super::*;

fn roundtrip(message: &Message, max_frame_bytes: usize) -> Message {
    let mut framer = Framer::new(max_frame_bytes);
    let frames = framer.encode(message).unwrap();
    assert!(frames.iter().all(|f| f.len() <= framer.max_frame_bytes()));
    let mut deframer = Deframer::new(Limits {
        max_frame_bytes: framer.max_frame_bytes(),
        ..Limits::default()
    });
    let mut out = Vec::new();
    for frame in &frames {
        out.extend(deframer.push(frame).unwrap());
    }
    assert_eq!(out.len(), 1);
    assert_eq!(deframer.buffered_bytes(), 0);
    out.pop().unwrap()
}

#[test]
fn tensor_roundtrip_is_bit_exact() {
    let values: Vec<f32> = (0..300_000).map(|i| (i as f32).sin() * 1e3).collect();
    let tensor = Tensor::from_f32(vec![3, 100_000], &values).unwrap();
    let message = Message::Activations {
        request: 7,
        seq: 1,
        pos0: 42,
        tensor,
    };
    let back = roundtrip(&message, 256 * 1024);
    assert_eq!(back, message);
    let Message::Activations { tensor, .. } = back else {
        unreachable!()
    };
    let got = tensor.to_f32().unwrap();
    assert!(
        got.iter()
            .zip(&values)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
}

/// A whole message in one buffer comes back equal, and a cut or damaged one is refused.
#[test]
fn whole_message_bytes_roundtrip_and_are_checked() {
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let message = Message::Forward {
        request: 3,
        seq: 2,
        layers: LayerRange { start: 0, end: 4 },
        pos0: 9,
        max_len: 64,
        sample: None,
        chain: None,
        tensor: Tensor::from_f32(vec![2, 500], &values).unwrap(),
    };
    let bytes = message.to_bytes().unwrap();
    assert_eq!(Message::from_bytes(bytes.clone()).unwrap(), message);
    assert_eq!(
        Message::from_bytes(Message::Resume.to_bytes().unwrap()).unwrap(),
        Message::Resume
    );
    assert!(Message::from_bytes(bytes[..bytes.len() - 1].to_vec()).is_err());
    assert!(Message::from_bytes(bytes[1..].to_vec()).is_err());
    assert!(Message::from_bytes(Vec::new()).is_err());
}

#[test]
fn tensors_check_their_shape() {
    assert!(Tensor::new(DType::F32, vec![2, 3], vec![0; 24]).is_ok());
    assert!(Tensor::new(DType::F32, vec![2, 3], vec![0; 23]).is_err());
    assert!(Tensor::new(DType::U8, vec![u64::MAX, 2], vec![]).is_err());
    assert!(Tensor::new(DType::U8, vec![1; 9], vec![0]).is_err());
    assert!(Tensor::from_values(DType::F16, vec![1], &[0f32]).is_err());
    let t = Tensor::from_values(DType::F16, vec![2], &[half::f16::ONE, half::f16::MAX]).unwrap();
    assert_eq!(t.bytes(), &[0x00, 0x3c, 0xff, 0x7b]);
    assert_eq!(
        t.to_values::<half::f16>().unwrap(),
        vec![half::f16::ONE, half::f16::MAX]
    );
    assert!(t.to_f32().is_err());
}

#[test]
fn frames_are_bounded_and_ordered() {
    let mut framer = Framer::new(1024);
    let mut deframer = Deframer::new(Limits {
        max_frame_bytes: 1024,
        ..Limits::default()
    });
    let messages: Vec<Message> = (0..50u32)
        .map(|i| match i % 3 {
            0 => Message::Token {
                request: 1,
                seq: i,
                step: i / 3,
                id: i * 3,
                passed_on: i % 2 == 0,
            },
            1 => Message::Probe {
                nonce: u64::from(i),
                payload: vec![i as u8; 5000 + i as usize],
            },
            _ => Message::Ping {
                nonce: u64::from(i),
                sent_us: 99,
            },
        })
        .collect();
    let mut got = Vec::new();
    for m in &messages {
        for frame in framer.encode(m).unwrap() {
            got.extend(deframer.push(&frame).unwrap());
        }
    }
    assert_eq!(got, messages);
}

#[test]
fn a_stream_split_anywhere_reassembles() {
    let mut framer = Framer::new(300);
    let messages = vec![
        Message::Hello(Hello::new("abc", 1 << 20, r#"{"gpu":"x"}"#.into())),
        Message::Probe {
            nonce: 1,
            payload: (0..2000).map(|i| i as u8).collect(),
        },
        Message::Close {
            reason: "bye".into(),
        },
    ];
    let stream: Vec<u8> = messages
        .iter()
        .flat_map(|m| framer.encode(m).unwrap())
        .flatten()
        .collect();
    for step in [1, 7, 28, 29, 300, 301, 5000] {
        let mut deframer = Deframer::new(Limits {
            max_frame_bytes: 300,
            ..Limits::default()
        });
        let mut got = Vec::new();
        for piece in stream.chunks(step) {
            got.extend(deframer.push(piece).unwrap());
        }
        assert_eq!(got, messages, "step {step}");
    }
}

#[test]
fn a_chain_with_too_many_end_ids_is_refused() {
    let forward = |n: usize| Message::Forward {
        request: 1,
        seq: 1,
        layers: LayerRange { start: 0, end: 1 },
        pos0: 0,
        max_len: 8,
        sample: None,
        chain: Some(super::Chain {
            max_steps: 4,
            end_ids: (0..n as u32).collect(),
        }),
        tensor: Tensor::from_values(DType::U32, vec![1], &[7u32]).unwrap(),
    };
    let roundtrip = |m: &Message| {
        let mut d = Deframer::new(Limits::default());
        let mut out = Vec::new();
        for f in Framer::new(1 << 16).encode(m).unwrap() {
            out.extend(d.push(&f)?);
        }
        Ok::<_, super::ProtocolError>(out)
    };
    let fine = forward(super::Chain::MAX_END_IDS);
    assert_eq!(roundtrip(&fine).unwrap(), vec![fine]);
    let err = roundtrip(&forward(super::Chain::MAX_END_IDS + 1)).unwrap_err();
    assert!(err.to_string().contains("end-of-generation"), "{err}");
}

#[test]
fn a_chain_stops_at_its_last_step_or_an_end_token() {
    let chain = super::Chain {
        max_steps: 3,
        end_ids: vec![2, 9],
    };
    assert!(chain.continues_after(0, 5));
    assert!(chain.continues_after(1, 5));
    assert!(!chain.continues_after(2, 5), "step 2 is the third and last");
    assert!(!chain.continues_after(0, 9), "an end token stops it");
    assert!(!chain.continues_after(u32::MAX, 5));
    let none = super::Chain {
        max_steps: 0,
        end_ids: vec![],
    };
    assert!(!none.continues_after(0, 5));
}

fn frames_of(message: &Message) -> Vec<Vec<u8>> {
    Framer::new(256).encode(message).unwrap()
}

fn small_limits() -> Limits {
    Limits {
        max_frame_bytes: 256,
        max_message_bytes: 4096,
    }
}

#[test]
fn corruption_is_refused_and_sticks() {
    let frames = frames_of(&Message::Probe {
        nonce: 1,
        payload: vec![7; 1000],
    });
    // A flipped payload bit.
    let mut d = Deframer::new(small_limits());
    let mut bad = frames[0].clone();
    bad[100] ^= 1;
    assert_eq!(d.push(&bad), Err(ProtocolError::Checksum));
    assert_eq!(d.push(&frames[0]), Err(ProtocolError::Failed));
    assert!(d.is_failed());
    // A skipped chunk.
    let mut d = Deframer::new(small_limits());
    d.push(&frames[0]).unwrap();
    assert!(matches!(
        d.push(&frames[2]),
        Err(ProtocolError::OutOfOrder { .. })
    ));
    // A replayed message.
    let ping = frames_of(&Message::Ping {
        nonce: 1,
        sent_us: 2,
    });
    let mut d = Deframer::new(small_limits());
    assert_eq!(d.push(&ping[0]).unwrap().len(), 1);
    assert!(matches!(
        d.push(&ping[0]),
        Err(ProtocolError::OutOfOrder { .. })
    ));
    // Unknown version.
    let mut d = Deframer::new(small_limits());
    let mut bad = ping[0].clone();
    bad[0] = 99;
    assert_eq!(d.push(&bad), Err(ProtocolError::Version(99)));
}

#[test]
fn oversized_claims_are_refused_before_buffering() {
    let big = Message::Probe {
        nonce: 1,
        payload: vec![0; 10_000],
    };
    let frames = frames_of(&big);
    let mut d = Deframer::new(small_limits());
    assert!(matches!(
        d.push(&frames[0]),
        Err(ProtocolError::MessageTooLarge { .. })
    ));
    assert_eq!(d.buffered_bytes(), 0);
    let frames = Framer::new(1024).encode(&big).unwrap();
    let mut d = Deframer::new(small_limits());
    assert!(matches!(
        d.push(&frames[0]),
        Err(ProtocolError::FrameTooLarge { .. })
    ));
    let mut framer = Framer::new(256);
    framer.set_peer_max_message_bytes(4096);
    assert!(matches!(
        framer.encode(&big),
        Err(ProtocolError::MessageTooLarge { .. })
    ));
}

#[test]
fn versions_negotiate() {
    let a = Hello::new("a", 1, String::new());
    let mut b = a.clone();
    assert_eq!(negotiate(&a, &b), Ok(PROTOCOL_VERSION));
    b.protocol = 9;
    b.min_protocol = 9;
    assert!(negotiate(&a, &b).is_err());
}

fn arb_dtype() -> impl Strategy<Value = DType> {
    prop_oneof![
        Just(DType::F32),
        Just(DType::F16),
        Just(DType::BF16),
        Just(DType::I32),
        Just(DType::U32),
        Just(DType::I8),
        Just(DType::U8),
    ]
}

fn arb_tensor() -> impl Strategy<Value = Tensor> {
    (arb_dtype(), prop::collection::vec(0u64..6, 0..4)).prop_flat_map(|(dtype, shape)| {
        let n: u64 = shape.iter().product::<u64>() * dtype.size() as u64;
        prop::collection::vec(any::<u8>(), n as usize)
            .prop_map(move |data| Tensor::new(dtype, shape.clone(), data).unwrap())
    })
}

fn arb_opt_f64() -> impl Strategy<Value = Option<f64>> {
    prop::option::of(-1e9f64..1e9)
}

fn arb_telemetry() -> impl Strategy<Value = Telemetry> {
    let load = (
        (
            any::<u64>(),
            any::<u32>(),
            -1e9f32..1e9,
            any::<u64>(),
            any::<u64>(),
        ),
        (
            0.0f64..1.0,
            0.0f64..1e6,
            arb_opt_f64(),
            any::<u32>(),
            any::<u32>(),
        ),
        prop::option::of((any::<u32>(), any::<u32>())),
    );
    let thermal = prop::option::of((".{0,12}", -50.0f64..150.0, arb_opt_f64()).prop_map(
        |(zone, temp_c, limit_c)| Thermal {
            zone,
            temp_c,
            limit_c,
        },
    ));
    let battery = prop::option::of(
        (0.0f64..=1.0, prop::option::of(any::<bool>()))
            .prop_map(|(level, charging)| Battery { level, charging }),
    );
    let visibility = prop::option::of(prop_oneof![
        Just(Visibility::Visible),
        Just(Visibility::Hidden)
    ]);
    let condition = (
        prop::option::of(".{0,10}"),
        prop::option::of(".{0,10}"),
        prop::option::of(any::<bool>()),
        thermal,
        battery,
        visibility,
        prop::option::of(".{0,20}"),
        prop::option::of(".{0,6}"),
    );
    let links = prop::collection::btree_map(
        ".{0,8}",
        (arb_opt_f64(), arb_opt_f64()).prop_map(|(rtt_ms, throughput_mb_s)| LinkReport {
            rtt_ms,
            throughput_mb_s,
        }),
        0..3,
    );
    (load, condition, links).prop_map(
        |(
            ((uptime_ms, queue_depth, tokens_per_s, used, total), stage, layers),
            (pressure, pressure_observed, throttled, thermal, battery, visibility, paused, backend),
            links,
        )| {
            let (utilization, kernel_ms, forward_ms, forwards, requests) = stage;
            Telemetry {
                uptime_ms,
                queue_depth,
                tokens_per_s,
                memory_used_bytes: used,
                memory_total_bytes: total,
                utilization,
                kernel_ms,
                forward_ms,
                forwards,
                requests,
                layers: layers.map(|(start, end)| LayerRange { start, end }),
                pressure,
                pressure_observed,
                throttled,
                thermal,
                battery,
                visibility,
                paused,
                backend,
                links,
                mean_batch: forward_ms.map(|_| tokens_per_s),
                kv: layers.map(|(start, end)| crate::protocol::KvReport {
                    blocks_used: start,
                    blocks_allocated: end,
                    blocks_budget: start.max(end),
                    block_positions: 16,
                }),
                busy_total_s: kernel_ms,
                passes_total: u64::from(forwards),
                seqs_total: uptime_ms,
            }
        },
    )
}

fn arb_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u8>(), any::<u8>(), any::<u64>(), ".{0,20}", ".{0,40}").prop_map(
            |(protocol, min_protocol, max_message_bytes, peer, capabilities)| {
                Message::Hello(Hello {
                    protocol,
                    min_protocol,
                    max_message_bytes,
                    peer,
                    capabilities,
                })
            }
        ),
        (any::<u64>(), any::<u64>()).prop_map(|(nonce, sent_us)| Message::Ping { nonce, sent_us }),
        (any::<u64>(), any::<u64>()).prop_map(|(nonce, sent_us)| Message::Pong { nonce, sent_us }),
        (any::<u64>(), any::<u32>(), any::<u32>(), arb_tensor()).prop_map(
            |(request, seq, pos0, tensor)| Message::Activations {
                request,
                seq,
                pos0,
                tensor
            }
        ),
        (
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<bool>()
        )
            .prop_map(|(request, seq, step, id, passed_on)| Message::Token {
                request,
                seq,
                step,
                id,
                passed_on,
            }),
        (
            (".{0,64}", any::<u32>(), any::<u32>(), ".{0,40}"),
            prop::option::of((".{0,20}", any::<u32>(), any::<u32>())),
            prop::option::of(".{0,20}")
        )
            .prop_map(|((model_hash, start, end, source), next, prev)| {
                Message::LoadShard {
                    model_hash,
                    layers: LayerRange { start, end },
                    source,
                    next: next.map(|(peer, start, end)| super::Hop {
                        peer,
                        layers: LayerRange { start, end },
                    }),
                    prev,
                    split: if start % 2 == 0 {
                        crate::placement::StageSplit::Layers
                    } else {
                        crate::placement::StageSplit::Tensor
                    },
                }
            }),
        arb_telemetry().prop_map(|t| Message::Telemetry(Box::new(t))),
        (any::<u64>(), prop::collection::vec(any::<u8>(), 0..3000))
            .prop_map(|(nonce, payload)| Message::Probe { nonce, payload }),
        (any::<u64>(), any::<u64>()).prop_map(|(nonce, bytes)| Message::ProbeAck { nonce, bytes }),
        (any::<u16>(), ".{0,40}").prop_map(|(code, text)| Message::Error { code, text }),
        ".{0,40}".prop_map(|reason| Message::Close { reason }),
        (
            (any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>()),
            prop::option::of((
                0f32..2.0,
                any::<u32>(),
                0f32..1.0,
                any::<u64>(),
                any::<u32>()
            )),
            prop::option::of((
                any::<u32>(),
                prop::collection::vec(any::<u32>(), 0..=super::Chain::MAX_END_IDS)
            )),
            arb_tensor()
        )
            .prop_map(|((request, seq, pos0, max_len), sample, chain, tensor)| {
                Message::Forward {
                    request,
                    seq,
                    layers: LayerRange {
                        start: seq,
                        end: pos0,
                    },
                    pos0,
                    max_len,
                    sample: sample.map(|(temperature, top_k, top_p, seed, step)| {
                        crate::kernels::SampleParams {
                            temperature,
                            top_k,
                            top_p,
                            seed,
                            step,
                        }
                    }),
                    chain: chain.map(|(max_steps, end_ids)| super::Chain { max_steps, end_ids }),
                    tensor,
                }
            }),
        (any::<u32>(), any::<u32>(), any::<u64>(), any::<u32>()).prop_map(
            |(start, end, weight_bytes, load_ms)| Message::ShardLoaded {
                layers: LayerRange { start, end },
                weight_bytes,
                load_ms,
            }
        ),
        any::<u64>().prop_map(|request| Message::EndRequest { request }),
        ".{0,64}".prop_map(|config| Message::Calibrate { config }),
        (0f64..1.0, 0f64..1.0, 0f64..1.0, 0f64..1.0).prop_map(|(a, b, c, d)| {
            Message::Calibration(super::Calibration {
                decode_s_per_layer: a,
                prefill_s_per_layer_token: b,
                call_overhead_s: c,
                head_s: d,
                tensor: (a > 0.5).then_some(crate::placement::SplitTiming {
                    decode_s_per_layer: b,
                    prefill_s_per_layer_token: c,
                    call_overhead_s: d,
                    head_s: a,
                    devices: (d * 8.0) as u32,
                }),
            })
        }),
        (any::<u64>(), any::<u32>(), any::<u16>(), ".{0,40}").prop_map(
            |(request, seq, code, text)| Message::RequestError {
                request,
                seq,
                code,
                text,
            }
        ),
        ".{0,40}".prop_map(|reason| Message::Pause { reason }),
        Just(Message::Resume),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn encode_decode_roundtrips(
        messages in prop::collection::vec(arb_message(), 1..6),
        frame in 64usize..2048,
        split in 1usize..4000,
    ) {
        let mut framer = Framer::new(frame);
        let limits = Limits { max_frame_bytes: framer.max_frame_bytes(), ..Limits::default() };
        // Frame by frame, as a data channel delivers them.
        let mut d = Deframer::new(limits);
        let mut got = Vec::new();
        let mut stream = Vec::new();
        for m in &messages {
            for f in framer.encode(m).unwrap() {
                prop_assert!(f.len() <= framer.max_frame_bytes());
                got.extend(d.push(&f).unwrap());
                stream.extend_from_slice(&f);
            }
        }
        prop_assert_eq!(&got, &messages);
        // The same frames as a byte stream cut at arbitrary points.
        let mut d = Deframer::new(limits);
        let mut got = Vec::new();
        for piece in stream.chunks(split) {
            got.extend(d.push(piece).unwrap());
        }
        prop_assert_eq!(&got, &messages);
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        pushes in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..600), 0..8),
    ) {
        let mut d = Deframer::new(small_limits());
        for p in &pushes {
            let _ = d.push(p);
            prop_assert!(d.buffered_bytes() as u64 <= small_limits().max_buffered_bytes());
        }
    }

    #[test]
    fn mutated_frames_never_panic(
        message in arb_message(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let mut frames = Framer::new(256).encode(&message).unwrap();
        for (at, value) in &flips {
            let frame = at.index(frames.len());
            let f = &mut frames[frame];
            let i = at.index(f.len());
            f[i] = *value;
        }
        let mut d = Deframer::new(small_limits());
        for f in &frames {
            if d.push(f).is_err() {
                break;
            }
        }
    }

    #[test]
    fn messages_with_valid_checksums_but_garbage_heads_never_panic(
        body in prop::collection::vec(any::<u8>(), 0..200),
        head in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        // Builds a well-formed frame around an arbitrary encoded message.
        let mut msg = body;
        msg.extend_from_slice(&head);
        msg.extend_from_slice(&(head.len() as u32).to_le_bytes());
        let mut frame = vec![0u8; FRAME_HEADER_BYTES];
        frame.extend_from_slice(&msg);
        frame[0] = PROTOCOL_VERSION;
        frame[1] = 3;
        frame[12..16].copy_from_slice(&(msg.len() as u32).to_le_bytes());
        frame[16..24].copy_from_slice(&(msg.len() as u64).to_le_bytes());
        let mut h = crc32fast::Hasher::new();
        h.update(&frame[..24]);
        h.update(&msg);
        let crc = h.finalize();
        frame[24..28].copy_from_slice(&crc.to_le_bytes());
        let _ = Deframer::new(small_limits()).push(&frame);
    }
}

/// The bytes of an encoded message (body, head, head length), without frames.
fn encoded(message: &Message) -> Vec<u8> {
    let e = super::message::encode(message).unwrap();
    let mut out = e.body.to_vec();
    out.extend_from_slice(&e.tail);
    out
}

#[test]
fn bulk_fields_travel_as_the_body() {
    let activations = Message::Activations {
        request: 7,
        seq: 1,
        pos0: 42,
        tensor: Tensor::from_f32(vec![2], &[1.0, 2.0]).unwrap(),
    };
    let mut want = [1.0f32.to_le_bytes(), 2.0f32.to_le_bytes()].concat();
    // Variant 3; request, seq, pos0; dtype F32 (0); shape of length 1: [2].
    want.extend_from_slice(&[3, 7, 1, 42, 0, 1, 2]);
    want.extend_from_slice(&7u32.to_le_bytes());
    assert_eq!(encoded(&activations), want);
    assert_eq!(super::message::decode(want).unwrap(), activations);

    let probe = Message::Probe {
        nonce: 5,
        payload: vec![9; 3],
    };
    let want = [&[9, 9, 9, 7, 5][..], &2u32.to_le_bytes()].concat();
    assert_eq!(encoded(&probe), want);
    assert_eq!(super::message::decode(want).unwrap(), probe);
}

#[test]
fn a_body_that_does_not_fit_the_head_is_refused() {
    // A ping with a body.
    let mut ping = vec![0xaa];
    ping.extend_from_slice(&encoded(&Message::Ping {
        nonce: 1,
        sent_us: 2,
    }));
    let err = super::message::decode(ping).unwrap_err();
    assert!(err.to_string().contains("unexpected body"), "{err}");
    // A tensor one byte short of its shape.
    let mut short = encoded(&Message::Activations {
        request: 1,
        seq: 1,
        pos0: 0,
        tensor: Tensor::from_f32(vec![2], &[1.0, 2.0]).unwrap(),
    });
    short.remove(0);
    assert!(matches!(
        super::message::decode(short),
        Err(ProtocolError::Tensor(_))
    ));
}

#[test]
fn telemetry_reads_as_the_fields_the_coordinator_weighs() {
    let t = Telemetry {
        utilization: 0.5,
        pressure: Some("serious".into()),
        throttled: Some(true),
        battery: Some(Battery {
            level: 0.3,
            charging: Some(false),
        }),
        visibility: Some(Visibility::Hidden),
        links: [(
            "w2".to_owned(),
            LinkReport {
                rtt_ms: Some(1.5),
                throughput_mb_s: None,
            },
        )]
        .into(),
        ..Telemetry::default()
    };
    let json = serde_json::to_value(&t).unwrap();
    assert_eq!(json["pressure"], "serious");
    assert_eq!(json["throttled"], true);
    assert_eq!(json["utilization"], 0.5);
    assert_eq!(json["battery"]["level"], 0.3);
    assert_eq!(json["battery"]["charging"], false);
    assert_eq!(json["visibility"], "hidden");
    assert_eq!(json["links"]["w2"]["rtt_ms"], 1.5);
    let battery: Battery = serde_json::from_value(serde_json::json!({"level": 0.8})).unwrap();
    assert_eq!(battery.charging, None);
}

/// `Telemetry` is boxed so that it does not set the size of every message a link or the
/// coordinator moves; the wire does not see the box: variant 6, then the struct's fields.
#[test]
fn a_message_is_small_and_boxed_telemetry_keeps_its_wire_bytes() {
    assert!(
        std::mem::size_of::<Message>() <= 160,
        "{} bytes",
        std::mem::size_of::<Message>()
    );
    let m = Message::Telemetry(Box::new(Telemetry {
        uptime_ms: 5,
        queue_depth: 2,
        backend: Some("cuda".into()),
        ..Telemetry::default()
    }));
    let mut head = vec![6, 5, 2];
    head.extend([0; 4]); // tokens_per_s
    head.extend([0, 0]); // memory used and total
    head.extend([0; 16]); // utilization, kernel_ms
    head.extend([0; 11]); // forward_ms .. paused
    head.extend([1, 4, b'c', b'u', b'd', b'a']); // backend
    head.push(0); // links
    head.extend([0, 0]); // mean_batch, kv
    head.extend([0; 8]); // busy_total_s
    head.extend([0, 0]); // passes_total, seqs_total
    let mut want = head.clone();
    want.extend((head.len() as u32).to_le_bytes());
    let encoded = super::message::encode(&m).unwrap();
    assert!(encoded.body.is_empty());
    assert_eq!(encoded.tail, want);
    assert_eq!(super::message::decode(want).unwrap(), m);
}
