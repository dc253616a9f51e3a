// acshim native file I/O engine: a thread pool that writes and reads tensor bytes to private files,
// with O_DIRECT through page-aligned bounce buffers, and the GIL released while callers wait.
//
// Same contract as the Python path (backends/fileio.py), byte for byte:
//   write(fd, address, nbytes, offset, direct): store nbytes from address at offset; with direct the
//     last block is zero-padded to ALIGNMENT; without it the range is flushed and dropped from the
//     page cache (fdatasync + posix_fadvise DONTNEED).
//   read(fd, address, nbytes, offset, direct): fill nbytes at address (aligned and padded by the
//     caller when direct).
// Jobs return errno (0 on success); the Python side raises OSError from it.
// Only pybind11 is included (not torch/extension.h): the engine sees raw addresses, the Python side
// keeps the tensors alive, and the build stays quick.
// Each worker's bounce buffer is its own anonymous mapping of kBounceBytes, populated when the worker
// starts and kept: small, so what a process holds for it is little, and steady, so a memory budget's
// guard, sampling the process between operators, sees it (a buffer touched and given back while a copy
// is in flight would not be), and it is resident before a budget's baseline is read (touched on its
// first unaligned write instead, it was 2 MiB of a plan's "held besides" on HF Llama 8x512).
//
// fork: a child process inherits the engine object but none of its threads (and maybe a locked mutex).
// The first submit in another process leaves the parent's state behind (never destroyed: its mutex
// may be held, its threads cannot be joined) and starts fresh threads, so a child never hangs.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <functional>
#include <memory>
#include <mutex>
#include <sys/mman.h>
#include <sys/types.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace py = pybind11;

namespace {

constexpr std::size_t kAlignment = 4096;
constexpr std::size_t kBounceBytes = 1u << 20;

std::size_t padded(std::size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

struct Job {
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  int error = 0;

  void finish(int err) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      error = err;
      done = true;
    }
    finished.notify_all();
  }

  int wait() {
    std::unique_lock<std::mutex> lock(mutex);
    finished.wait(lock, [this] { return done; });
    return error;
  }

  bool is_done() {
    std::lock_guard<std::mutex> lock(mutex);
    return done;
  }
};

struct Request {
  bool write;
  int fd;
  char* address;
  std::size_t nbytes;
  off_t offset;
  bool direct;
  std::shared_ptr<Job> job;
};

int write_all(int fd, const char* data, std::size_t n, off_t offset) {
  std::size_t done = 0;
  while (done < n) {
    ssize_t count = ::pwrite(fd, data + done, n - done, offset + static_cast<off_t>(done));
    if (count < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (count == 0) return EIO;
    done += static_cast<std::size_t>(count);
  }
  return 0;
}

int read_all(int fd, char* data, std::size_t n, off_t offset) {
  std::size_t done = 0;
  while (done < n) {
    ssize_t count = ::pread(fd, data + done, n - done, offset + static_cast<off_t>(done));
    if (count < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (count == 0) return EIO;  // short read: the file is shorter than what was written
    done += static_cast<std::size_t>(count);
  }
  return 0;
}

class Engine {
 public:
  explicit Engine(int threads) : threads_(threads < 1 ? 1 : threads) { start(); }

  ~Engine() {
    if (state_->pid != ::getpid()) return;  // a forked child's copy: nothing of the parent to stop
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stopping = true;
    }
    state_->wake.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  std::shared_ptr<Job> submit(bool write, int fd, std::uintptr_t address, std::size_t nbytes,
                              std::int64_t offset, bool direct) {
    // Called with the GIL held (no call_guard): submits are serialised, and none is under way when
    // the process forks (os.fork holds the GIL too), so the check needs no lock of its own.
    if (state_->pid != ::getpid()) restart_after_fork();
    auto job = std::make_shared<Job>();
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->queue.push_back(Request{write, fd, reinterpret_cast<char*>(address), nbytes,
                                      static_cast<off_t>(offset), direct, job});
    }
    state_->wake.notify_one();
    return job;
  }

 private:
  // What the workers share: one per process (a child gets its own, see restart_after_fork).
  struct State {
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<Request> queue;
    bool stopping = false;
    pid_t pid = ::getpid();
  };

  void start() {
    state_ = std::make_shared<State>();
    for (int i = 0; i < threads_; ++i) workers_.emplace_back([state = state_] { run(*state); });
  }

  void restart_after_fork() {
    // The parent's threads do not exist here: their handles cannot be joined (std::terminate) nor
    // its state freed (a worker may have held the mutex at fork). Both are left behind, once.
    new std::vector<std::thread>(std::move(workers_));
    new std::shared_ptr<State>(std::move(state_));
    workers_.clear();
    start();
  }

  static void run(State& state) {
    // MAP_POPULATE: resident from the worker's start (the engine starts before a budget's baseline is
    // read), not from its first unaligned write, which a planner's measurement would take for its own
    void* mapped = ::mmap(nullptr, kBounceBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                          -1, 0);
    char* bounce = mapped == MAP_FAILED ? nullptr : static_cast<char*>(mapped);  // page-aligned: O_DIRECT's too
    for (;;) {
      Request request;
      {
        std::unique_lock<std::mutex> lock(state.mutex);
        state.wake.wait(lock, [&state] { return state.stopping || !state.queue.empty(); });
        if (state.queue.empty()) break;
        request = std::move(state.queue.front());
        state.queue.pop_front();
      }
      int error = bounce == nullptr ? ENOMEM : (request.write ? do_write(request, bounce) : do_read(request, bounce));
      request.job->finish(error);
    }
    if (bounce != nullptr) ::munmap(bounce, kBounceBytes);
  }

  static int do_write(const Request& r, char* bounce) {
    if (!r.direct) {
      int error = write_all(r.fd, r.address, r.nbytes, r.offset);
      if (error == 0 && ::fdatasync(r.fd) != 0) error = errno;
      if (error == 0) ::posix_fadvise(r.fd, r.offset, static_cast<off_t>(r.nbytes), POSIX_FADV_DONTNEED);
      return error;
    }
    std::size_t done = 0;
    while (done < r.nbytes) {
      std::size_t chunk = std::min(kBounceBytes, r.nbytes - done);
      std::memcpy(bounce, r.address + done, chunk);
      std::size_t aligned = padded(chunk);
      std::memset(bounce + chunk, 0, aligned - chunk);
      int error = write_all(r.fd, bounce, aligned, r.offset + static_cast<off_t>(done));
      if (error != 0) return error;
      done += chunk;
    }
    return 0;
  }

  static int do_read(const Request& r, char* bounce) {
    bool aligned = reinterpret_cast<std::uintptr_t>(r.address) % kAlignment == 0 && r.nbytes % kAlignment == 0;
    if (!r.direct || aligned) {
      int error = read_all(r.fd, r.address, r.nbytes, r.offset);
      if (error == 0 && !r.direct) ::posix_fadvise(r.fd, r.offset, static_cast<off_t>(r.nbytes), POSIX_FADV_DONTNEED);
      return error;
    }
    std::size_t done = 0;
    while (done < r.nbytes) {
      std::size_t chunk = std::min(kBounceBytes, r.nbytes - done);
      int error = read_all(r.fd, bounce, padded(chunk), r.offset + static_cast<off_t>(done));
      if (error != 0) return error;
      std::memcpy(r.address + done, bounce, chunk);
      done += chunk;
    }
    return 0;
  }

  int threads_;
  std::shared_ptr<State> state_;
  std::vector<std::thread> workers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "acshim native file I/O engine (thread pool, O_DIRECT, GIL released while waiting)";
  m.attr("ALIGNMENT") = kAlignment;
  py::class_<Job, std::shared_ptr<Job>>(m, "Job")
      .def("wait", &Job::wait, py::call_guard<py::gil_scoped_release>(),
           "Block (without the GIL) until the job finishes; returns errno, 0 on success.")
      .def("done", &Job::is_done);
  py::class_<Engine>(m, "Engine")
      .def(py::init<int>(), py::arg("threads"))
      .def("submit", &Engine::submit, py::arg("write"), py::arg("fd"), py::arg("address"), py::arg("nbytes"),
           py::arg("offset"), py::arg("direct"), "Queue one write or read; returns a Job.");
}
