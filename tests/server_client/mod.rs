//! What the server tests share: a running `verity serve` (the real binary, on 127.0.0.1 port 0,
//! its address read from its stdout) and an HTTP client for it. Each test binary uses its own
//! part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::Value;

/// A running `verity serve`, killed on drop; its stderr (the request log) is collected.
pub struct Server {
    child: Child,
    pub base: String,
    pub log: Arc<Mutex<String>>,
    pub agent: ureq::Agent,
}

impl Server {
    pub fn start(model: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_verity"))
            .args(["--device", "cpu", "serve", "--port", "0", "--model"])
            .arg(model)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn verity serve");
        let log = Arc::new(Mutex::new(String::new()));
        let mut stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let base = line
            .trim()
            .strip_prefix("verity serve: listening on ")
            .unwrap_or_else(|| panic!("no address line: {line:?}, log: {}", log.lock().unwrap()))
            .to_string();
        assert!(base.starts_with("http://127.0.0.1:"), "{base}");
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        Server {
            child,
            base,
            log,
            agent,
        }
    }

    /// The server's log once `ready` holds for it (the log is read from a pipe by another
    /// thread, so a line written before a response may arrive after it); panics after 30 s.
    pub fn log_when(&self, ready: impl Fn(&str) -> bool) -> String {
        let start = std::time::Instant::now();
        loop {
            let log = self.log.lock().unwrap().clone();
            if ready(&log) {
                return log;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the log never got there: {log}"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends the server the signal `name` ("TERM", "INT") with kill(1).
    pub fn signal(&self, name: &str) {
        let sent = Command::new("kill")
            .args([format!("-{name}"), self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -{name} failed");
    }

    /// The server's exit status; panics unless it exits within `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let start = std::time::Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "still running after {limit:?}: {}",
                self.log.lock().unwrap()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's resident memory in bytes (Linux /proc).
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|l| l.trim().strip_suffix("kB"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        kb * 1024
    }

    /// POSTs `body`; returns the status and the JSON body.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let mut r = self
            .agent
            .post(format!("{}{path}", self.base))
            .send_json(body)
            .unwrap();
        let status = r.status().as_u16();
        (status, r.body_mut().read_json().unwrap())
    }

    /// POSTs raw bytes (for bodies that are not JSON).
    pub fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let mut r = self
            .agent
            .post(format!("{}{path}", self.base))
            .content_type("application/json")
            .send(body)
            .unwrap();
        let status = r.status().as_u16();
        (status, r.body_mut().read_json().unwrap())
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        let mut r = self
            .agent
            .get(format!("{}{path}", self.base))
            .call()
            .unwrap();
        (r.status().as_u16(), r.body_mut().read_json().unwrap())
    }

    /// A 200 completion's body.
    pub fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.post(path, body);
        assert_eq!(status, 200, "{v}");
        v
    }

    /// Opens a streaming request and reads its first `events` `data:` lines; the stream stays
    /// open until the returned lines are dropped (a client that goes away then).
    pub fn open_stream(
        &self,
        path: &str,
        body: &Value,
        events: usize,
    ) -> std::io::Lines<BufReader<impl Read>> {
        let r = self
            .agent
            .post(format!("{}{path}", self.base))
            .send_json(body)
            .unwrap();
        let mut lines = BufReader::new(r.into_body().into_reader()).lines();
        let mut seen = 0;
        while seen < events {
            if lines.next().unwrap().unwrap().starts_with("data: ") {
                seen += 1;
            }
        }
        lines
    }

    /// A streaming request's `data:` payloads, up to and without `[DONE]` (which must come).
    pub fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let r = self
            .agent
            .post(format!("{}{path}", self.base))
            .send_json(body)
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let content_type = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        let mut chunks = Vec::new();
        for line in BufReader::new(r.into_body().into_reader()).lines() {
            let line = line.unwrap();
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                return chunks;
            }
            chunks.push(serde_json::from_str(data).unwrap());
        }
        panic!("the stream ended without [DONE]: {chunks:?}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
