<?php

// The worker base class, its exceptions and the task, as Phorge declares them.

class PhabricatorWorkerPermanentFailureException extends Exception {}

final class PhabricatorWorkerYieldException extends Exception {
  private $duration;

  public function __construct($duration) {
    $this->duration = $duration;
    parent::__construct();
  }

  public function getDuration() {
    return $this->duration;
  }
}

final class PhabricatorWorkerLeaseQuery {
  const DEFAULT_WAIT = 300;

  public static function getDefaultWaitBeforeRetry() {
    return self::DEFAULT_WAIT;
  }
}

abstract class PhabricatorWorkerTask {
  private $fields = array();
  private $executionException;

  public function __call($method, array $args) {
    $field = lcfirst(substr($method, 3));
    if (!strncmp($method, 'set', 3)) {
      $this->fields[$field] = $args[0];
      return $this;
    }
    if (!strncmp($method, 'get', 3)) {
      return idx($this->fields, $field);
    }
    throw new Exception(sprintf('No method %s.', $method));
  }

  public function getID() {
    return idx($this->fields, 'iD');
  }

  public function setID($id) {
    $this->fields['iD'] = $id;
    return $this;
  }

  public function setExecutionException($ex) {
    $this->executionException = $ex;
    return $this;
  }

  public function getExecutionException() {
    return $this->executionException;
  }
}

final class PhabricatorWorkerActiveTask extends PhabricatorWorkerTask {
  private $ephemeral = false;

  public function makeEphemeral() {
    $this->ephemeral = true;
    return $this;
  }
}

abstract class PhabricatorWorker {
  const PRIORITY_DEFAULT = 2000;

  private $data;
  private $queuedTasks = array();
  private $currentWorkerTask;

  final public function __construct($data) {
    $this->data = $data;
  }

  abstract protected function doWork();

  public function getRequiredLeaseTime() {
    return null;
  }

  public function getMaximumRetryCount() {
    return null;
  }

  public function getWaitBeforeRetry(PhabricatorWorkerTask $task) {
    return null;
  }

  public function setCurrentWorkerTask(PhabricatorWorkerTask $task) {
    $this->currentWorkerTask = $task;
    return $this;
  }

  public function getCurrentWorkerTask() {
    return $this->currentWorkerTask;
  }

  final protected function getTaskData() {
    return $this->data;
  }

  final protected function getTaskDataValue($key, $default = null) {
    return is_array($this->data) ? idx($this->data, $key, $default) : $default;
  }

  final public function executeTask() {
    $this->doWork();
  }

  final protected function queueTask(
    $class,
    array $data,
    array $options = array()) {
    $this->queuedTasks[] = array($class, $data, $options);
    return $this;
  }

  final protected function getQueuedTasks() {
    return $this->queuedTasks;
  }
}
