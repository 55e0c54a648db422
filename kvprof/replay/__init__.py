"""Replay: a recorded session's I/O issued again on candidate storage, at its recorded times,
while a new session is recorded there with the recording's phase windows (`kvprof replay`;
`kvprof compare SESSION NEW` then sets one against the other).

plan (what to issue: Plan, FilePlan) -> gate (the phases' order: Gate) -> issue (the
replaying threads, and the child process file calls come from) -> stats (how late) ->
run (replay(): the candidate prepared, the new session recorded, the figures).

What is issued, one of two layers:
- block (a device, or a directory without file calls to replay): every block request of the
  chosen phases (op, size, offset within its device's range), O_DIRECT, on the device or a
  scratch file; the candidate merges no requests meanwhile (queue/nomerges, put back after):
  the recorded ones were merged already. A session sampled past --event-rate is scaled up
  to its aggregate tier's counts (analysis/scaleup.py).
- syscall (a directory, where the session has the engine's file calls): every read, write,
  fsync and fdatasync on the KV caches' files (`--cache`), each recorded file a file of its
  own in a scratch folder, at the offset the call had, asking the bytes it asked,
  O_DIRECT where the engine's file was; files read before the replay writes them are laid
  down first, out of the page cache. Made by a process of its own, which the new session
  traces by pid (kvprof never traces its own files).

Both by JOBS threads per lane (reads, writes, syncs) that take the lane's calls in order,
each sleeping until its call's time. Block requests (and file calls with --open-loop) go out
at their times whether or not the ones before have completed (open loop, up to JOBS in
flight a lane), so latency is measured under the recorded arrivals. File calls by default
keep each recorded thread's order and pace (FilePlan.after/gap): a call waits for its
thread's call before it and the thread's own time after that, and each phase piece keeps
its recorded length after the one before (Gate.shift), so a slower candidate moves the rest
as it moves a closed-loop engine's steps. Either way the replay measures per phase how late
it issued each planned call's bytes against when that was due (in a shifting replay, at its
offset in its moved piece). Each call is issued in the phase it was recorded in: the first
call of a phase waits until every call of the one before has completed (Gate), which on a
slow candidate stretches that phase.

Not fio: fio 3.33 replaying an iolog waits for each line's time by spinning (one core per
job, which here is the CPU the candidate's I/O needs), and through one asynchronous queue
leaves up to its depth - 1 of the requests unissued while counting them done. `kvprof export
--fio-iolog` writes the block requests for fio, for those who replay with it.

The new session holds the recording's phase windows, moved to the replay's clock (its first
call at the recording's first), each phase from where the replay started it to where it
started the next (Gate), sent to its recorder as the replay decides them
(kvprof/phases/replayed.py): its report, exact tier and idle time per phase and `compare`
split the same way, each call in the phase it had in the recording; the replay says how long
each phase took against the recording (`phases`).

Safety: as `kvprof calibrate`: a directory gets scratch files (deleted afterwards), a raw
device that is mounted or held is refused, and one holding data is refused unless --force.
"""
