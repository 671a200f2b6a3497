// A key-prefixing view of a Paddle store, handed to Python as Paddle's own ``Store`` type.
//
// Why: every gloo group (and every static pipeline ring) runs a rendezvous whose keys
// ("0" .. "n-1") are the same for all groups, and a TCP store cannot delete keys, so groups
// sharing the job's store read each other's addresses.  Paddle keeps its prefix store in C++,
// and its Python ``Store`` cannot be subclassed from Python (the C++ methods do not dispatch to
// Python overrides), so without this each group needed a TCP store of its own, listening on a
// port of its own.  A prefix view puts every group's keys under its own prefix on the job's
// store: no new listening socket, nothing left running when the group goes.
//
// How it reaches Paddle: the module is built against Paddle's pybind11 headers with the
// internals id of the installed libpaddle (setup.py reads it), so both share one type registry
// and a ``std::shared_ptr<phi::distributed::Store>`` crosses as ``paddle.base.libpaddle.Store``,
// which ``ProcessGroupGloo.create`` takes.  Import fails with a message when the registry is not
// shared (a module built against another Paddle).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeindex>
#include <utility>
#include <vector>

#include "paddle/phi/core/distributed/store/store.h"

namespace py = pybind11;
using phi::distributed::Store;

namespace paddle_hybrid {

class PrefixStore : public Store {
 public:
  // ``what`` names the owner and the setting of the deadline, for the timeout message; ``places``
  // names each rank of the group by its place in it (gloo's rendezvous key of a rank is its place).
  PrefixStore(std::shared_ptr<Store> inner,
              std::string prefix,
              double timeout_s,
              std::string what,
              std::vector<std::string> places)
      : Store(static_cast<int>(std::ceil(timeout_s))),
        inner_(std::move(inner)),
        prefix_(std::move(prefix)),
        timeout_s_(timeout_s),
        what_(std::move(what)),
        places_(std::move(places)) {}

  // Each key written through the view raises a counter beside it, and ``check`` reads that counter:
  // a counter read (``add(key, 0)``) answers at once on every Paddle, where Paddle 3.2's TCP store
  // has no ``check`` and its ``get`` blocks for the store's own timeout.  The value is written
  // before its counter, so a key seen is a key readable.
  int64_t add(const std::string& key, int64_t value) override {
    const int64_t result = inner_->add(prefix_ + key, value);
    inner_->add(written(key), 1);
    return result;
  }

  bool check(const std::string& key) override { return inner_->add(written(key), 0) > 0; }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    inner_->set(prefix_ + key, value);
    inner_->add(written(key), 1);
  }

  std::vector<uint8_t> get(const std::string& key) override {
    wait(key);  // the inner store's own wait would use its timeout, not this one
    return inner_->get(prefix_ + key);
  }

  // Polls ``check`` so the wait ends at this store's deadline (the job's store waits for its own
  // timeout, which is not the user's).  Pauses grow from 1 ms to 20 ms: a rendezvous waits for keys its
  // peers set moments later.
  void wait(const std::string& key) override {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    auto pause = std::chrono::milliseconds(1);
    while (!check(key)) {
      if (std::chrono::steady_clock::now() >= deadline) {
        std::ostringstream msg;
        msg << "paddle_hybrid: " << what_ << ": key '" << prefix_ << key << "' was not set within " << timeout_s_
            << " s: " << writer(key) << " did not reach the rendezvous (crashed, hung, or running other code)";
        throw std::runtime_error(msg.str());
      }
      std::this_thread::sleep_for(pause);
      if (pause < std::chrono::milliseconds(20)) pause *= 2;
    }
  }

 private:
  std::string written(const std::string& key) const { return prefix_ + key + "/.written"; }

  // Who writes ``key``: gloo's rendezvous key of a rank ends in its place in the group.
  std::string writer(const std::string& key) const {
    const std::string last = key.substr(key.find_last_of('/') + 1);
    const bool number = !last.empty() && last.size() < 9 && last.find_first_not_of("0123456789") == std::string::npos;
    if (number && static_cast<size_t>(std::stoi(last)) < places_.size()) return places_[std::stoi(last)];
    return "a peer";
  }

  std::shared_ptr<Store> inner_;
  std::string prefix_;
  double timeout_s_;
  std::string what_;
  std::vector<std::string> places_;
};

}  // namespace paddle_hybrid

PYBIND11_MODULE(_prefix_store, m) {
  py::module_::import("paddle.base.libpaddle");  // registers Paddle's Store type first
  if (py::detail::get_type_info(std::type_index(typeid(Store))) == nullptr) {
    PyErr_SetString(PyExc_ImportError,
                    "paddle_hybrid._prefix_store was built against another Paddle (its pybind11 registry is not "
                    "libpaddle's, so it cannot hand Paddle a Store). Rebuild: pip install --no-build-isolation --use-pep517 -e .");
    throw py::error_already_set();
  }
  m.def(
      "prefix_store",
      [](std::shared_ptr<Store> inner,
         const std::string& prefix,
         double timeout_s,
         const std::string& what,
         const std::vector<std::string>& places) {
        if (!inner) throw std::invalid_argument("paddle_hybrid: prefix_store needs a store, got None");
        if (!(timeout_s > 0)) throw std::invalid_argument("paddle_hybrid: prefix_store needs a timeout > 0 s");
        return std::shared_ptr<Store>(
            std::make_shared<paddle_hybrid::PrefixStore>(std::move(inner), prefix, timeout_s, what, places));
      },
      py::arg("inner"), py::arg("prefix"), py::arg("timeout_s"), py::arg("what"), py::arg("places"),
      "A view of ``inner`` that puts every key under ``prefix``; waits end after ``timeout_s`` seconds with an error "
      "naming ``what`` and, from ``places`` (a name per place in the group), the rank that did not write its "
      "key.");
}
