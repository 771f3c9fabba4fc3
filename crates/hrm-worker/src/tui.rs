//! The terminal interface: one start/stop control (`s` or space), progress of the current
//! batch, the activity log, this worker's contribution, network stats and the leaderboard.
//! [`draw`] is a pure function of the shared [`View`], so tests render it with ratatui's test
//! backend.

use crate::status::{Level, Status, View, WorkerState};
use hrm_wire::badges_for;
use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Gauge, List, ListItem, Paragraph, Row, Table};
use std::time::Duration;

/// What a key press asks of the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// The start/stop control: start when idle, stop (after the current batch) when running.
    Toggle,
    /// Stop after the current batch, then exit; a second press exits at once.
    Quit,
}

/// Maps a key to a command.
pub fn command_for(code: KeyCode, modifiers: KeyModifiers) -> Option<Command> {
    match code {
        KeyCode::Char('s') | KeyCode::Char(' ') | KeyCode::Enter => Some(Command::Toggle),
        KeyCode::Char('q') | KeyCode::Esc => Some(Command::Quit),
        KeyCode::Char('c') if modifiers.contains(KeyModifiers::CONTROL) => Some(Command::Quit),
        _ => None,
    }
}

/// Runs the interface on this thread. `tick` is called about five times a second with the
/// key command pressed since the last call, if any; it returns true to close the interface.
pub fn run(status: &Status, mut tick: impl FnMut(Option<Command>) -> bool) -> std::io::Result<()> {
    let mut terminal = ratatui::init();
    let result = (|| loop {
        terminal.draw(|frame| draw(frame, &status.snapshot()))?;
        let mut command = None;
        if event::poll(Duration::from_millis(200))?
            && let Event::Key(key) = event::read()?
            && key.kind == KeyEventKind::Press
        {
            command = command_for(key.code, key.modifiers);
        }
        if tick(command) {
            return Ok(());
        }
    })();
    ratatui::restore();
    result
}

fn state_style(state: WorkerState) -> Style {
    let color = match state {
        WorkerState::Idle => Color::Gray,
        WorkerState::Training => Color::Green,
        WorkerState::Uploading => Color::Cyan,
    };
    Style::default().fg(color).add_modifier(Modifier::BOLD)
}

fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

fn badges(list: &[String]) -> String {
    if list.is_empty() {
        "-".into()
    } else {
        list.join(" ")
    }
}

/// Draws the whole interface from `view`.
pub fn draw(frame: &mut Frame, view: &View) {
    let [header, progress, middle, board, log] = Layout::vertical([
        Constraint::Length(4),
        Constraint::Length(5),
        Constraint::Length(7),
        Constraint::Length(8),
        Constraint::Min(4),
    ])
    .areas(frame.area());
    draw_header(frame, header, view);
    draw_progress(frame, progress, view);
    let [mine, network] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(middle);
    draw_contribution(frame, mine, view);
    draw_network(frame, network, view);
    draw_leaderboard(frame, board, view);
    draw_log(frame, log, view);
}

fn draw_header(frame: &mut Frame, area: Rect, view: &View) {
    let control = if view.stopping {
        "stopping after this batch…"
    } else if view.running {
        "[s] stop"
    } else {
        "[s] start"
    };
    let who = view.username.clone().unwrap_or_else(|| {
        view.worker_id
            .map_or("not connected".into(), |id| id.to_string())
    });
    let lines = vec![
        Line::from(vec![
            Span::styled(format!(" {} ", view.state), state_style(view.state)),
            Span::raw("  "),
            Span::styled(control, Style::default().add_modifier(Modifier::BOLD)),
            Span::raw("   [q] quit"),
        ]),
        Line::from(format!(
            " {} · hub {} · {}",
            view.activity,
            view.hub_url,
            if view.connected {
                who
            } else {
                "offline".into()
            }
        )),
    ];
    frame.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(" hrm worker ")),
        area,
    );
}

fn draw_progress(frame: &mut Frame, area: Rect, view: &View) {
    let block = Block::default().borders(Borders::ALL).title(" Progress ");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let [gauge_area, numbers] =
        Layout::vertical([Constraint::Length(1), Constraint::Length(2)]).areas(inner);
    let (ratio, label) = match &view.batch {
        Some(batch) => (
            batch.step as f64 / batch.steps.max(1) as f64,
            format!(
                "batch {} · {} samples · {} · step {}/{}",
                &batch.batch_id.simple().to_string()[..8],
                batch.samples,
                batch.model_version,
                batch.step,
                batch.steps
            ),
        ),
        None => (0.0, "no batch in progress".into()),
    };
    frame.render_widget(
        Gauge::default()
            .gauge_style(Style::default().fg(Color::Green))
            .ratio(ratio.clamp(0.0, 1.0))
            .label(label),
        gauge_area,
    );
    let loss = view.last_loss.map_or("-".into(), |l| format!("{l:.4}"));
    let rate = view
        .tokens_per_second
        .map_or("-".into(), |r| format!("{r:.0}"));
    let lines = vec![
        Line::from(format!(
            " tokens processed {} · loss {loss} · {rate} tokens/s",
            thousands(view.session.tokens as i64)
        )),
        Line::from(format!(
            " this session: {} batches uploaded ({} KiB), {} lost · model {}",
            view.session.batches,
            thousands((view.session.upload_bytes >> 10) as i64),
            view.session.lost_batches,
            view.model_version.as_deref().unwrap_or("not loaded")
        )),
    ];
    frame.render_widget(Paragraph::new(lines), numbers);
}

fn draw_contribution(frame: &mut Frame, area: Rect, view: &View) {
    let lines = match &view.contribution {
        Some(mine) => vec![
            Line::from(format!(
                " batches {} ({} validated)",
                thousands(mine.total_batches),
                thousands(mine.validated_batches)
            )),
            Line::from(format!(" tokens {}", thousands(mine.total_tokens))),
            Line::from(format!(
                " reputation {:.2} · rank {}",
                mine.reputation_score,
                mine.rank.map_or("-".into(), |r| format!("#{r}"))
            )),
            Line::from(format!(" badges {}", badges(&mine.badges))),
            Line::from(format!(
                " next badge {}",
                next_badge(mine.validated_batches)
            )),
        ],
        None => vec![Line::from(" not known yet")],
    };
    frame.render_widget(
        Paragraph::new(lines).block(
            Block::default()
                .borders(Borders::ALL)
                .title(" Your contribution "),
        ),
        area,
    );
}

/// The next badge and how many validated batches it needs.
fn next_badge(validated: i64) -> String {
    hrm_wire::BADGES
        .iter()
        .find(|(at, _)| validated < *at)
        .map_or("all earned".into(), |(at, name)| {
            format!("{name} in {} batches", thousands(at - validated))
        })
}

fn draw_network(frame: &mut Frame, area: Rect, view: &View) {
    let lines = match &view.network {
        Some(net) => vec![
            Line::from(format!(
                " version {} ({} versions)",
                net.current_version.as_deref().unwrap_or("-"),
                net.num_versions
            )),
            Line::from(format!(
                " workers {} active / {} registered",
                net.workers_active, net.workers_total
            )),
            Line::from(format!(
                " batches {} pending · {} assigned · {} completed",
                thousands(net.batches.pending),
                thousands(net.batches.assigned),
                thousands(net.batches.completed)
            )),
            Line::from(format!(
                " updates {} pending · {} aggregated · {} rejected",
                net.updates_pending, net.updates_aggregated, net.updates_rejected
            )),
            Line::from(format!(" tokens {}", thousands(net.total_tokens))),
        ],
        None => vec![Line::from(" not known yet")],
    };
    frame.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(" Network ")),
        area,
    );
}

fn draw_leaderboard(frame: &mut Frame, area: Rect, view: &View) {
    let me = view.worker_id;
    let rows = view.leaderboard.iter().map(|entry| {
        let style = if Some(entry.worker_id) == me {
            Style::default()
                .add_modifier(Modifier::BOLD)
                .fg(Color::Yellow)
        } else {
            Style::default()
        };
        // Badges as the hub computed them, or from the counts when an older hub sent none.
        let earned = if entry.badges.is_empty() {
            badges_for(entry.validated_batches)
        } else {
            entry.badges.clone()
        };
        Row::new(vec![
            Cell::from(format!("#{}", entry.rank)),
            Cell::from(
                entry
                    .username
                    .clone()
                    .unwrap_or_else(|| entry.worker_id.simple().to_string()[..8].to_string()),
            ),
            Cell::from(thousands(entry.validated_batches)),
            Cell::from(thousands(entry.total_tokens)),
            Cell::from(format!("{:.2}", entry.reputation_score)),
            Cell::from(badges(&earned)),
        ])
        .style(style)
    });
    let table = Table::new(
        rows,
        [
            Constraint::Length(5),
            Constraint::Min(12),
            Constraint::Length(10),
            Constraint::Length(14),
            Constraint::Length(6),
            Constraint::Length(12),
        ],
    )
    .header(Row::new(["rank", "worker", "batches", "tokens", "rep", "badges"]).bold())
    .block(
        Block::default()
            .borders(Borders::ALL)
            .title(" Leaderboard (badges at 1K, 10K, 100K validated batches) "),
    );
    frame.render_widget(table, area);
}

fn draw_log(frame: &mut Frame, area: Rect, view: &View) {
    let visible = area.height.saturating_sub(2) as usize;
    let items: Vec<ListItem> = view
        .log
        .iter()
        .rev()
        .take(visible)
        .rev()
        .map(|line| {
            let color = match line.level {
                Level::Info => Color::Reset,
                Level::Warn => Color::Yellow,
                Level::Error => Color::Red,
            };
            let time = line
                .at
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() % 86_400)
                .unwrap_or(0);
            ListItem::new(Line::from(vec![
                Span::styled(
                    format!("{:02}:{:02}:{:02} ", time / 3600, time / 60 % 60, time % 60),
                    Style::default().fg(Color::DarkGray),
                ),
                Span::styled(line.message.clone(), Style::default().fg(color)),
            ]))
        })
        .collect();
    frame.render_widget(
        List::new(items).block(
            Block::default()
                .borders(Borders::ALL)
                .title(" Activity (UTC) "),
        ),
        area,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::BatchProgress;
    use hrm_wire::{BatchCounts, GlobalStats, LeaderboardEntry, WorkerStats};
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;
    use uuid::Uuid;

    fn render(view: &View) -> String {
        let mut terminal = Terminal::new(TestBackend::new(110, 40)).unwrap();
        terminal.draw(|frame| draw(frame, view)).unwrap();
        let buffer = terminal.backend().buffer().clone();
        let mut text = String::new();
        for y in 0..buffer.area.height {
            for x in 0..buffer.area.width {
                text.push_str(buffer[(x, y)].symbol());
            }
            text.push('\n');
        }
        text
    }

    fn busy_view() -> View {
        let status = Status::new("http://127.0.0.1:8090");
        let me = Uuid::from_u128(7);
        status.update(|v| {
            v.state = WorkerState::Training;
            v.running = true;
            v.connected = true;
            v.worker_id = Some(me);
            v.username = Some("ada".into());
            v.activity = "training batch".into();
            v.batch = Some(BatchProgress {
                batch_id: Uuid::from_u128(0xabcdef12 << 96),
                model_version: "v0.1.7".into(),
                samples: 512,
                step: 3,
                steps: 8,
            });
            v.last_loss = Some(4.25);
            v.tokens_per_second = Some(1234.0);
            v.session.tokens = 12_345;
            v.contribution = Some(WorkerStats {
                worker_id: me,
                username: Some("ada".into()),
                total_batches: 1_205,
                validated_batches: 1_200,
                total_tokens: 9_876_543,
                reputation_score: 0.98,
                updates_pending: 1,
                updates_rejected: 0,
                badges: badges_for(1_200),
                rank: Some(2),
                created_at: chrono::Utc::now(),
                last_seen: None,
            });
            v.network = Some(GlobalStats {
                current_version: Some("v0.1.7".into()),
                num_versions: 7,
                workers_total: 5,
                workers_active: 3,
                batches: BatchCounts {
                    pending: 100,
                    assigned: 3,
                    completed: 2_000,
                    failed: 0,
                },
                updates_pending: 2,
                updates_aggregated: 40,
                updates_rejected: 1,
                updates_awaiting_verification: 0,
                updates_held: 0,
                total_tokens: 1_000_000,
                last_aggregation_at: None,
            });
            v.leaderboard = vec![
                LeaderboardEntry {
                    rank: 1,
                    worker_id: Uuid::from_u128(9),
                    username: Some("grace".into()),
                    validated_batches: 12_000,
                    total_tokens: 50_000_000,
                    reputation_score: 1.0,
                    badges: badges_for(12_000),
                },
                LeaderboardEntry {
                    rank: 2,
                    worker_id: me,
                    username: Some("ada".into()),
                    validated_batches: 1_200,
                    total_tokens: 9_876_543,
                    reputation_score: 0.98,
                    badges: badges_for(1_200),
                },
            ];
        });
        status.info("leased batch abcdef12");
        status.error("the hub is unreachable; retrying in 30s");
        status.snapshot()
    }

    #[test]
    fn a_busy_worker_shows_progress_stats_leaderboard_and_log() {
        let screen = render(&busy_view());
        for expected in [
            "TRAINING",
            "[s] stop",
            "step 3/8",
            "512 samples",
            "tokens processed 12,345",
            "loss 4.2500",
            "1234 tokens/s",
            "batches 1,205 (1,200 validated)",
            "reputation 0.98",
            "rank #2",
            "badges 1K",
            "10K in 8,800 batches",
            "workers 3 active / 5 registered",
            "grace",
            "1K 10K",
            "leased batch abcdef12",
            "the hub is unreachable",
        ] {
            assert!(
                screen.contains(expected),
                "missing {expected:?} in\n{screen}"
            );
        }
    }

    #[test]
    fn an_idle_worker_offers_start() {
        let status = Status::new("http://127.0.0.1:8090");
        let screen = render(&status.snapshot());
        assert!(screen.contains("IDLE"), "{screen}");
        assert!(screen.contains("[s] start"), "{screen}");
        assert!(screen.contains("no batch in progress"), "{screen}");
        status.update(|v| {
            v.running = true;
            v.stopping = true;
        });
        assert!(render(&status.snapshot()).contains("stopping after this batch"));
    }

    #[test]
    fn keys_map_to_the_one_control_and_quit() {
        assert_eq!(
            command_for(KeyCode::Char('s'), KeyModifiers::NONE),
            Some(Command::Toggle)
        );
        assert_eq!(
            command_for(KeyCode::Char(' '), KeyModifiers::NONE),
            Some(Command::Toggle)
        );
        assert_eq!(
            command_for(KeyCode::Char('c'), KeyModifiers::CONTROL),
            Some(Command::Quit)
        );
        assert_eq!(command_for(KeyCode::Char('x'), KeyModifiers::NONE), None);
    }
}
