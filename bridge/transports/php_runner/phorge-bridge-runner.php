<?php

/**
 * phorge-bridge's PHP runner: one long-lived PHP process on a worker host that
 * bootstraps the operator's Phorge checkout once, then runs the tasks the
 * bridge sends it, one at a time, as phd's taskmaster runs many tasks in one
 * process.
 *
 *   php phorge-bridge-runner.php PHORGE_ROOT REQUESTS_FD ANSWERS_FD
 *
 * The bridge talks to it on two pipes of their own, the file descriptors the
 * command line names (requests from the bridge, answers to it), so nothing a
 * task prints (stdout, stderr, PHP's own error display) can corrupt the
 * protocol.
 *
 * Every message is a frame: a 4-byte big-endian length, then that many bytes
 * of a JSON object. The runner answers a "ready" frame once booted (or
 * "boot-failed"), then one frame per request; a run whose PHP dies (a fatal
 * error, exit()) answers "died" from the shutdown function before the
 * process ends. It exits at the end of its request pipe, so it never outlives
 * the worker that started it. How a task runs is PhorgeBridgeTaskRun.php, the
 * same code as the worker.execute Conduit method's.
 *
 * Written for PHP 7.2 (Phorge's minimum).
 */
final class PhorgeBridgeRunner {

  // Kept back for the shutdown function of a run that exhausted memory.
  const RESERVE_BYTES = 1048576;

  const BOOTING = 'booting';
  const IDLE = 'idle';
  const RUNNING = 'running';
  const DONE = 'done';

  private $requests;
  private $answers;
  private $reserve;
  private $state = self::BOOTING;

  public function main(array $argv) {
    if (count($argv) !== 4) {
      fwrite(STDERR, "usage: phorge-bridge-runner.php PHORGE_ROOT REQUESTS_FD ANSWERS_FD\n");
      exit(2);
    }
    $this->requests = fopen('php://fd/'.(int)$argv[2], 'rb');
    $this->answers = fopen('php://fd/'.(int)$argv[3], 'wb');
    if (!$this->requests || !$this->answers) {
      fwrite(STDERR, "phorge-bridge runner: the bridge's pipes are not open\n");
      exit(2);
    }
    $this->reserve = str_repeat('.', self::RESERVE_BYTES);
    register_shutdown_function(array($this, 'onShutdown'));

    $root = rtrim($argv[1], '/');
    try {
      $this->boot($root);
    } catch (Throwable $ex) {
      $this->state = self::DONE;
      $this->send(array(
        'type' => 'boot-failed',
        'message' => get_class($ex).': '.$ex->getMessage(),
      ));
      exit(1);
    }
    $this->state = self::IDLE;
    $this->send(array(
      'type' => 'ready',
      'pid' => getmypid(),
      'php' => PHP_VERSION,
    ));

    while (($request = $this->receive()) !== null) {
      $this->send($this->answer($request));
    }
    exit(0);
  }

  // Shipped one directory up, shared with the Conduit methods.
  private static function taskRunPath() {
    return dirname(dirname(__FILE__)).'/PhorgeBridgeTaskRun.php';
  }

  private function boot($root) {
    // The bridge's own copy, before Phorge includes src/extensions/ (which
    // may hold another copy, declared only when this one is not).
    require_once self::taskRunPath();
    if (!strlen($root) || !is_file($root.'/scripts/init/init-script.php')) {
      throw new Exception(
        sprintf('"%s" is not a Phorge checkout (no scripts/init/init-script.php)', $root));
    }
    // As Phorge's own scripts start.
    ob_start();
    try {
      require_once $root.'/scripts/init/init-script.php';
    } finally {
      $printed = ob_get_clean();
    }
    if (!class_exists('PhabricatorWorker')) {
      throw new Exception('Phorge did not load: '.trim($printed));
    }
  }

  private function answer(array $request) {
    $op = isset($request['op']) ? $request['op'] : null;
    if (!in_array($op, array('run', 'describe', 'wait'), true)) {
      return array('type' => 'error', 'message' => 'unknown op');
    }
    $spec = isset($request['task']) && is_array($request['task'])
      ? $request['task']
      : array();
    // Read and checked as worker.execute reads its tasks; a malformed spec
    // is an invalid request, answered as one.
    try {
      $task = PhorgeBridgeTaskRun::newTaskFromSpec($spec);
    } catch (PhorgeBridgeTaskSpecException $ex) {
      return array('type' => 'error', 'message' => $ex->getMessage());
    }

    switch ($op) {
      case 'run':
        if (PhabricatorEnv::isReadOnly()) {
          return array('type' => 'read-only');
        }
        $this->state = self::RUNNING;
        $result = PhorgeBridgeTaskRun::run($task);
        $this->state = self::IDLE;
        return array('type' => 'result') + $result;
      case 'describe':
        return array('type' => 'described') + PhorgeBridgeTaskRun::describe($task);
      case 'wait':
        return array('type' => 'wait') + PhorgeBridgeTaskRun::waitAfterDeath(
          $task,
          idx($request, 'message'));
    }
    return array('type' => 'error', 'message' => 'unknown op');
  }

  /**
   * A run that ends the process (a fatal error, memory exhausted, exit())
   * still says why; nothing is said at a normal exit.
   */
  public function onShutdown() {
    $this->reserve = null;
    $booting = ($this->state === self::BOOTING);
    if (!$booting && $this->state !== self::RUNNING) {
      return;
    }
    @ini_set('memory_limit', '-1');
    $output = '';
    while (ob_get_level() > 0) {
      $output = ob_get_clean().$output;
    }
    $error = error_get_last();
    $fatal = E_ERROR | E_CORE_ERROR | E_COMPILE_ERROR | E_USER_ERROR | E_PARSE;
    if ($error && ($error['type'] & $fatal)) {
      $message = sprintf(
        'PHP Fatal error: %s in %s:%d',
        $error['message'],
        $error['file'],
        $error['line']);
    } else if (!$booting) {
      $message = 'the task ended its PHP process (exit() or die())';
    } else {
      $message = 'Phorge ended the process while booting: '.trim($output);
    }
    $this->send(array(
      'type' => $booting ? 'boot-failed' : 'died',
      'message' => PhorgeBridgeTaskRun::cleanMessage($message),
      'output' => PhorgeBridgeTaskRun::cleanMessage($output),
    ));
  }

  private function receive() {
    $header = $this->readExactly(4);
    if ($header === null) {
      return null;
    }
    $length = unpack('N', $header);
    $body = $this->readExactly($length[1]);
    if ($body === null) {
      return null;
    }
    $request = json_decode($body, true);
    return is_array($request) ? $request : array();
  }

  private function readExactly($length) {
    $data = '';
    while (strlen($data) < $length) {
      $chunk = fread($this->requests, $length - strlen($data));
      if ($chunk === false || $chunk === '') {
        return null;
      }
      $data .= $chunk;
    }
    return $data;
  }

  private function send(array $message) {
    $body = json_encode(
      $message,
      JSON_INVALID_UTF8_SUBSTITUTE | JSON_PARTIAL_OUTPUT_ON_ERROR);
    $frame = pack('N', strlen($body)).$body;
    while (strlen($frame)) {
      $written = @fwrite($this->answers, $frame);
      if ($written === false || $written === 0) {
        // The bridge is gone; nobody is left to tell.
        exit(1);
      }
      $frame = substr($frame, $written);
    }
    fflush($this->answers);
  }

}

$runner = new PhorgeBridgeRunner();
$runner->main($argv);
