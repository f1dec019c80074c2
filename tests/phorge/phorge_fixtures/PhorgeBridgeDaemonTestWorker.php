<?php

/**
 * tests/phorge/test_queue_daemon.py's task class: copied into the test
 * Phorge's src/extensions/ for the module's tests and removed afterwards; never
 * shipped. Does nothing, unless its data says {"fail": true}: then a temporary
 * failure, retried an hour later (the test sees the daemon go on past it).
 */
final class PhorgeBridgeDaemonTestWorker extends PhabricatorWorker {

  protected function doWork() {
    $data = $this->getTaskData();
    if (is_array($data) && !empty($data['fail'])) {
      throw new Exception('PhorgeBridgeDaemonTestWorker: failing on purpose');
    }
  }

  public function getWaitBeforeRetry(PhabricatorWorkerTask $task) {
    return 3600;
  }

}

/**
 * The same, for a second class (the tests' sentinel: rows the daemon always runs).
 */
final class PhorgeBridgeDaemonOtherTestWorker extends PhabricatorWorker {

  protected function doWork() {
    return;
  }

}
