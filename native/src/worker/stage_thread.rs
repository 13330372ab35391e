//! The stage server on its own thread.

use std::sync::Arc;

use cairn_engine::Device;
use cairn_engine::gguf::TensorSource;
use cairn_engine::protocol::{Message, Telemetry};
use cairn_engine::worker::{StageServer, load_shard};
use tokio::sync::{mpsc, oneshot};

use crate::link::LinkSender;

pub enum Job {
    /// A message for the stage; its reply, if any, goes straight onto the link: a step's
    /// answer is on every token's critical path, and each task it passes through on the way
    /// costs a thread wake-up.
    Handle(Message, LinkSender),
    /// Load layers from `src` and install them (answers `ShardLoaded`). The
    /// same model and layers already loaded just drop their caches.
    Install {
        src: Box<dyn TensorSource + Send>,
        model: String,
        start: usize,
        end: usize,
        reply: oneshot::Sender<Result<Message, String>>,
    },
    Telemetry(oneshot::Sender<Result<Telemetry, String>>),
}

#[derive(Clone)]
pub struct StageThread {
    jobs: mpsc::UnboundedSender<Job>,
}

impl StageThread {
    pub fn spawn(device: Arc<Device>) -> std::io::Result<StageThread> {
        let (jobs, mut rx) = mpsc::unbounded_channel::<Job>();
        std::thread::Builder::new()
            .name("cairn-stage".into())
            .spawn(move || {
                let mut server = StageServer::new(device.clone());
                let mut loaded: Option<(String, usize, usize)> = None;
                while let Some(job) = rx.blocking_recv() {
                    match job {
                        Job::Handle(m, link) => {
                            if let Some(reply) = pollster::block_on(server.handle(m)) {
                                // Waits only while the link's send queue is full; an error
                                // means the link is gone, which its reader notices.
                                let _ = pollster::block_on(link.send(reply));
                            }
                        }
                        Job::Install {
                            src,
                            model,
                            start,
                            end,
                            reply,
                        } => {
                            let key = (model, start, end);
                            if loaded.as_ref() == Some(&key) && server.layers().is_some() {
                                server.clear_requests();
                                let _ = reply.send(Ok(Message::ShardLoaded {
                                    layers: cairn_engine::protocol::LayerRange {
                                        start: start as u32,
                                        end: end as u32,
                                    },
                                    weight_bytes: 0,
                                    load_ms: 0,
                                }));
                                continue;
                            }
                            // Free the old shard before loading the new one.
                            server.clear();
                            loaded = None;
                            let r = pollster::block_on(load_shard(
                                device.clone(),
                                src.as_ref(),
                                start,
                                end,
                            ));
                            drop(src);
                            let _ = reply.send(match r {
                                Ok((shard, msg)) => {
                                    server.set_shard(shard);
                                    loaded = Some(key);
                                    Ok(msg)
                                }
                                Err(e) => Err(format!("loading layers {start}..{end}: {e}")),
                            });
                        }
                        Job::Telemetry(reply) => {
                            let _ = reply.send(Ok(server.telemetry()));
                        }
                    }
                }
            })?;
        Ok(StageThread { jobs })
    }

    pub fn send(&self, job: Job) {
        let _ = self.jobs.send(job);
    }

    /// Sends a job built around a reply channel and waits for the reply.
    pub async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, String>>) -> Job,
    ) -> Result<T, String> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx));
        rx.await
            .map_err(|_| "the stage thread has stopped".to_owned())?
    }
}
